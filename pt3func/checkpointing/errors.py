"""The error a checkpoint that cannot be written, found or trusted raises."""


class CheckpointError(Exception):
    """A checkpoint is missing, corrupt, truncated or does not fit the target; the message names the file or key."""
