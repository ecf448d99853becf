"""The command-line face of a run: one line and an exit status, only where the plugin owns the
process.

The plugin owns the process when the run comes through one of fairseq's training commands
(``fairseq-train``, ``fairseq-hydra-train``, ``python -m fairseq_cli.train``, ``python -m
fairseq_fsdp2.hydra_train`` and its script, each also as a torchrun or SLURM rank) or runs on a
rank the plugin started itself (process/spawn.py), and the run is not one job of a hydra
``--multirun`` sweep. There an error ends the process with one ``fairseq_fsdp2: error: ...``
line and its status (2: bad input, 1: training stopped). Anywhere else (a Python program, a
notebook, fairseq's own test helpers, a sweep) the error is raised, as an FSDP2Error the caller
can catch, and the caller decides.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn, Optional

from ..errors import DEBUG_ENV, PROG, FSDP2Error, prints_bad_input

_started_by_plugin = False  # a rank process/spawn.py started: a process of the plugin's own


def mark_started_by_plugin() -> None:
    """In a rank process the plugin started (process/spawn.py): the plugin owns it."""
    global _started_by_plugin
    _started_by_plugin = True


def owns_process() -> bool:
    """Whether a run's error may end this process (see the module's docstring): a rank the
    plugin started, or a run that came through the ``cli_main`` of fairseq's training commands
    (``fairseq_cli.train``, ``fairseq_cli.hydra_train``: their console scripts, ``python -m``,
    torchrun's and SLURM's ranks, the plugin's hydra entry, a wrapper script calling one), not
    as one job of a hydra sweep."""
    if _in_hydra_multirun():
        return False
    if _started_by_plugin:
        return True
    return any(os.path.basename(path) in TRAINING_COMMANDS for path in _fairseq_cli_mains())


def in_fairseq_command() -> bool:
    """Whether one of fairseq's command-line tools (any ``fairseq_cli`` module's ``cli_main``:
    fairseq-train, -generate, -validate, -interactive, ...) is running this code: its
    command-line errors end it, as argparse's own do (command_line/parse_errors.py)."""
    return next(_fairseq_cli_mains(), None) is not None


#: the files of fairseq's training commands in fairseq_cli (``python -m fairseq_cli.train``
#: runs its file as ``__main__``: another module object, the same file)
TRAINING_COMMANDS = ("train.py", "hydra_train.py")


def _fairseq_cli_mains():
    """The files of the ``fairseq_cli`` modules whose ``cli_main`` is on the caller's stack,
    innermost first. fairseq_cli's modules are not imported (its hydra_train warns about its
    hydra decorator when imported): frames are matched by file, walked with CPython's
    ``sys._getframe`` (no public API tells who called)."""
    import fairseq_cli
    package = os.path.dirname(os.path.abspath(fairseq_cli.__file__))
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "cli_main":
            path = os.path.abspath(code.co_filename)
            if os.path.dirname(path) == package:
                yield path
        frame = frame.f_back


def _in_hydra_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def stop(error: FSDP2Error, owned: bool, *, leave_now: bool = False,
         local_rank: Optional[int] = None) -> NoReturn:
    """Report ``error``: in a process the plugin owns, one line and its exit status (bad input,
    status 2, on one rank per machine: errors.prints_bad_input, given this ``local_rank``; with
    ``leave_now``, at once, without the interpreter's teardown: used only when other ranks may
    be stuck in a collective with this one, a lost rank); elsewhere raise it."""
    if not owned or os.environ.get(DEBUG_ENV):
        raise error
    if not error.reported and (error.exit_status != 2 or prints_bad_input(local_rank)):
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
    if leave_now:
        logging.shutdown()
        sys.stdout.flush()
        os._exit(error.exit_status)
    sys.exit(error.exit_status)
