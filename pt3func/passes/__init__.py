"""Passes over the traced program; each takes and returns a `torch.fx.GraphModule`."""
