"""The errors a checkpoint raises: one that cannot be used, one damaged."""


class CheckpointError(ValueError):
  """A checkpoint that cannot be used: missing, from another run, or (see
  :class:`CorruptCheckpointError`) unreadable."""


class CorruptCheckpointError(CheckpointError):
  """A finished checkpoint whose files cannot be read back or do not match
  their checksums (truncated, deleted or damaged after the save)."""
