"""Errors the plugin reports as one line (``fairseq_fsdp2: error: ...``), without a traceback
unless FAIRSEQ_FSDP2_DEBUG=1: exit status 2 for bad input (stopped before any work), 1 for a
failure during training (see TrainingStopped). Raised to the caller where the plugin does not own
the process (launch/cli.py)."""
from __future__ import annotations

from typing import Optional


def first_line(error: BaseException, limit: Optional[int] = 200) -> str:
    """The first line of an error's text (at most ``limit`` characters; None: all of it), or
    its type's name when it has none: what a one-line report quotes of a long message."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


class FSDP2Error(Exception):
    """Base class: something the user can fix. ``exit_status``: the status a training command
    ends with when it reports the error (a program that trains in-process catches it);
    ``reported``: its line was printed already (by the rank process that failed)."""

    exit_status = 2
    reported = False


class OptionError(FSDP2Error, ValueError):
    """A bad or conflicting option."""


class CheckpointError(FSDP2Error):
    """A checkpoint that cannot be read, is incomplete, or does not fit the model."""


class TrainingStopped(FSDP2Error):
    """Training cannot go on: a rank was lost, memory ran out, a save failed. The other ranks
    may be inside a collective, so the process leaves at once (``os._exit``); the work since the
    last checkpoint is lost, and the same command resumes from it."""

    exit_status = 1


class RankLostError(TrainingStopped):
    """Another rank died or stopped answering."""


class SaveFailed(TrainingStopped):
    """Writing a checkpoint failed (disk full, unwritable directory); the previous ones are
    intact."""


class ExportFailed(TrainingStopped):
    """Training finished, but the consolidated export at its end failed; the sharded
    checkpoints are intact."""


class RanksFailed(TrainingStopped):
    """A rank the plugin started (spawn.py) failed; it reported its own error."""

    reported = True

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


class OutOfMemory(TrainingStopped):
    """A rank ran out of memory; the message carries every rank's last logged peak."""
