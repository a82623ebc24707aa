"""Tracing a pure step into an aten FX graph."""
