"""Errors the plugin reports as one line (``fairseq_fsdp2: error: ...``) and exit status 2."""


class FSDP2Error(Exception):
    """Base class: bad input the user can fix; no traceback unless FAIRSEQ_FSDP2_DEBUG=1."""


class OptionError(FSDP2Error, ValueError):
    """A bad or conflicting option."""


class CheckpointError(FSDP2Error):
    """A checkpoint that cannot be read, is incomplete, or does not fit the model."""
