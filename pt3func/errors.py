"""The exceptions pt3func raises; every message names the culprit (pytree path, shape, spec, source line)."""


class TracingError(Exception):
    """The step could not be traced into a static program (impure, data-dependent, bad arguments)."""


class ImpureFunctionError(TracingError):
    """The step mutates an input, prints a tensor or otherwise has side effects."""


class DataDependentControlFlowError(TracingError):
    """The step branches in Python on a tensor's value (`if`, `while`, `.item()`, `bool(t)`)."""


class DonationError(TracingError):
    """A donation cannot be honoured, or a donated tensor was used after the call that consumed it."""


class ShardingError(ValueError):
    """A sharding annotation does not fit a value or a mesh."""
