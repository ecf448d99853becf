"""Errors the plugin reports as one line (``fairseq_fsdp2: error: ...``), without a traceback
unless FAIRSEQ_FSDP2_DEBUG=1: exit status 2 for bad input (stopped before any work), 1 for a
failure during training (see TrainingStopped). Raised to the caller where the plugin does not own
the process (command_line/exits.py)."""
from __future__ import annotations

import errno
import os
import shutil
import sys
from typing import Optional

#: set to 1 for tracebacks (and argparse's usage) instead of one-line errors
DEBUG_ENV = "FAIRSEQ_FSDP2_DEBUG"
#: what the plugin's error lines start with: "fairseq_fsdp2: error: ...", as fairseq-train's
PROG = "fairseq_fsdp2"


def unwritable(directory: str) -> Optional[str]:
    """Why nothing can be created in ``directory`` (made with its missing parents first), or
    None: the nearest part of it that exists is a plain file, or a directory this process cannot
    write (its permissions, a read-only file system: os.access says so even to root)."""
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        return f"{existing} is not a writable directory"
    return None


def no_space_left(error: BaseException, directory: str) -> Optional[str]:
    """``no space left on device (DIR's file system has X MiB free)`` if ``error``, or an error
    it wraps (its cause, its context, torch.distributed.checkpoint's per-rank ``failures``), says
    that the disk is full: errno ENOSPC, or torch.save's short write (``unexpected pos``, its
    only word for it) with under 1 MiB left; else None."""
    try:
        free: Optional[int] = shutil.disk_usage(directory).free
    except OSError:
        free = None
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        text = str(e)
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in text or (
                "unexpected pos" in text and free is not None and free < 2 ** 20):
            shown = "an unknown amount" if free is None else f"{free / 2 ** 20:.1f} MiB"
            return f"no space left on device ({directory}'s file system has {shown} free)"
        failures = getattr(e, "failures", None)
        todo += [e.__cause__, e.__context__, *(
            f[0] for f in (failures.values() if isinstance(failures, dict) else ())
            if isinstance(f, tuple) and f and isinstance(f[0], BaseException))]
    return None


def prints_bad_input(local_rank: Optional[int] = None) -> bool:
    """Whether this process prints a bad-input line (exit status 2). Every rank finds the same
    bad input (the same command line; on one machine the same files), so one rank per machine
    says it: the first one there. Per machine, not only global rank 0: a file one node lacks (a
    data directory, a checkpoint) is found by that node's ranks alone. ``local_rank``: this
    process's rank on its machine where the process knows it (fairseq's
    ``distributed_training.device_id`` once the launch settings are filled in: ranks the plugin
    spawns have no launcher environment saying it); else the launcher's environment
    (torchrun's LOCAL_RANK, SLURM's SLURM_LOCALID); a process no launcher started prints."""
    if local_rank is None:
        found = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID"))
        local_rank = int(found) if found is not None and found.isdigit() else 0
    return local_rank == 0


def first_line(error: BaseException, limit: Optional[int] = 200) -> str:
    """The first line of an error's text (at most ``limit`` characters; None: all of it), or
    its type's name when it has none: what a one-line report quotes of a long message."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def report_bad_input(prog: str, problem: object) -> int:
    """A command-line tool's bad input (estimate, prepare_data, plot_memory): ``PROG: error:
    PROBLEM`` alone on stderr; returns 2, argparse's status for a bad flag, for the tool's
    ``main`` to return (its ``__main__`` block exits with it: the library never exits)."""
    print(f"{prog}: error: {problem}", file=sys.stderr, flush=True)
    return 2


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
    """Training cannot go on: a rank was lost, memory ran out, a save failed. The work since the
    last checkpoint is lost, and the same command resumes from it. After a lost rank a training
    command leaves at once (``os._exit``): the other ranks may be inside a collective with it
    (process/lifecycle.py)."""

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
