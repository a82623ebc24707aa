"""Passes over the traced program; each takes and returns a `torch.fx.GraphModule`."""

from __future__ import annotations

from torch import fx

from pt3func.trace.capture import eliminate_dead_code


def replace_outputs(gm: fx.GraphModule, outs: list) -> None:
    """Make `outs` the program's outputs (in the output node's own container type), drop the nodes that no longer
    reach an output, and recompile."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    output_node.args = (type(output_node.args[0])(outs),)
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
