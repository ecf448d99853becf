"""One FSDP2 run's process-wide state, in one object: created when the run starts (setup.py),
closed when it ends (lifecycle.py), so that the next run in the same process (a hydra sweep's
next job, a program that trains again) starts fresh and the caller's process is left as it was.

What a run holds while it lasts, and what closing it undoes:
- whether fairseq builds the model on the meta device (sharding/meta_build.py, asked by
  integration/registration.py's patch when fairseq builds the model);
- the background saves (checkpoint/async_save.py): the save in flight, their process group,
  the staging thread;
- the heartbeat thread (heartbeat.py), stopped and joined: a daemon thread left inside a store
  call at interpreter exit aborts the process (heartbeat.Heartbeat says why);
- the SIGTERM handler (sigterm.py), the previous one restored;
- the warning filters the run adds (quiet.RUN_WARNINGS: warnings that are expected while all
  is well, each with its reason), removed again, the caller's own untouched;
- the process group, destroyed if the run opened it, and fairseq's cached global group where
  the run created it (it would point at a destroyed group in a later run);
- what the run's parts changed on the process and registered to undo (``on_close``): the
  collective timeout of a caller's process group (trainer/fsdp2_trainer.py), the CUDA device
  (setup.py), the moments' kept buffers of every thread and their tables
  (optimizer/moments/blockwise_8bit.release_workspaces, registered by the trainer), undone last first.

Module state: only ``current()``, the run in progress in this process (fairseq builds the
trainer and the model from inside its own ``main``, with no way to pass the run along), and the
count of runs this process has opened.
"""
from __future__ import annotations

import itertools
import logging
import signal
import sys
import threading
from typing import Callable, Optional

import torch.distributed as dist
from fairseq.distributed import utils as fairseq_distributed_utils

from ..checkpoint.async_save import BackgroundSaves
from ..errors import OptionError
from . import heartbeat, quiet
from .heartbeat import Heartbeat

logger = logging.getLogger(__name__)

#: fairseq's attribute on get_global_group caching its group (fairseq/distributed/utils.py);
#: tests/test_in_process.py fails if fairseq stops caching there
FAIRSEQ_GROUP_CACHE = "_global_group"


class RunContext:
    """The state of one FSDP2 run on this process (a rank, or the task that starts ranks)."""

    def __init__(self, *, builds_on_meta: bool, background_saves: bool, index: int = 0):
        #: the how-manieth run of this process (from 0): every rank of a program runs the same
        #: sequence of runs, so each run's rendezvous keys are kept apart by it (setup.py)
        self.index = index
        self.builds_on_meta = builds_on_meta
        self.saves: Optional[BackgroundSaves] = BackgroundSaves() if background_saves else None
        self.heartbeat: Optional[Heartbeat] = None
        #: the process group did not exist when the run started: the run destroys it
        self.owns_group = not (dist.is_available() and dist.is_initialized())
        #: fairseq's cached global group did not exist either: the run drops it (in a
        #: caller's group too, where it would outlive the run and the caller's group)
        self._fairseq_cached = hasattr(fairseq_distributed_utils.get_global_group,
                                       FAIRSEQ_GROUP_CACHE)
        self._sigterm: Optional[object] = None  # the handler before the run's, to restore
        self._sigterm_set = False
        self._quiet = quiet.install(quiet.RUN_WARNINGS)  # exactly these, removed by close()
        self._undo: list[Callable[[], None]] = []  # on_close's, run last first
        self.closed = False

    def on_close(self, undo: Callable[[], None]) -> None:
        """Have ``close`` call ``undo`` (no argument): what a part of the run changed on the
        process, put back. Called last first, each even if an earlier one failed (a warning
        says so)."""
        self._undo.append(undo)

    def start_heartbeat(self, rank: int, world_size: int) -> Optional[Heartbeat]:
        """The trainer's heartbeat (None for one rank): stopped when the run closes."""
        if self.heartbeat is None:
            self.heartbeat = heartbeat.start(rank, world_size)
        return self.heartbeat

    def set_sigterm_handler(self, handler) -> None:
        """Install the run's SIGTERM handler; close() restores the previous one. Python only
        lets the main thread set handlers: a run in another thread (a sweep driver's worker)
        keeps the caller's; so does a caller that installed a SIGTERM handler of its own."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None) and \
                not self._sigterm_set:
            return
        previous = signal.signal(signal.SIGTERM, handler)
        if not self._sigterm_set:
            self._sigterm, self._sigterm_set = previous, True

    def close(self) -> None:
        """Undo what the run set up, in order; safe to call twice. Makes no collective call:
        after a failure the other ranks may be gone (a successful run meets them first,
        lifecycle.py)."""
        global _current
        if self.closed:
            return
        self.closed = True
        try:
            if self.heartbeat is not None and not self.heartbeat.stop():
                logger.warning("the heartbeat thread did not stop; it ends with the process")
            if self.saves is not None:
                self.saves.close()
            self._run_undo()  # while the process group is still there
            fairseq_group_cache = fairseq_distributed_utils.get_global_group
            if (self.owns_group or not self._fairseq_cached) and \
                    hasattr(fairseq_group_cache, FAIRSEQ_GROUP_CACHE):
                delattr(fairseq_group_cache, FAIRSEQ_GROUP_CACHE)
            if self.owns_group and dist.is_initialized():
                dist.destroy_process_group()
            if self._sigterm_set:
                signal.signal(signal.SIGTERM, self._sigterm)
        finally:
            quiet.remove(self._quiet)
            if _current is self:
                _current = None

    def _run_undo(self) -> None:
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as e:  # noqa: BLE001 - the rest of the teardown still runs
                logger.warning("the end of the run could not undo %s: %s: %s",
                               getattr(undo, "__qualname__", undo), type(e).__name__, e)


_current: Optional[RunContext] = None
_runs = itertools.count()  # runs opened in this process


#: what fairseq keeps for the whole process as attributes of its functions, from one training
#: run to the next: the best validation score (``checkpoint_utils.save_checkpoint.best``,
#: which decides checkpoint_best.pt) and --patience's count (``train.should_stop_early``'s
#: ``best`` and ``num_runs``). A resumed run reads its best back from its checkpoint.
FAIRSEQ_RUN_RECORDS = (("fairseq.checkpoint_utils", "save_checkpoint", ("best",)),
                       ("fairseq_cli.train", "should_stop_early", ("best", "num_runs")))


def forget_previous_runs() -> None:
    """Start a training run as a fresh process would: without the best score and --patience
    count a previous run in this process left in fairseq (FAIRSEQ_RUN_RECORDS). Without it a
    second run in a program, or the next job of a hydra sweep, saves checkpoint_best.pt only
    where it beats the first run and counts the first run's validations towards --patience."""
    for module, function, names in FAIRSEQ_RUN_RECORDS:
        holder = getattr(sys.modules.get(module), function, None)
        if holder is None:  # not imported: nothing recorded
            continue
        for name in names:
            vars(holder).pop(name, None)


def open_run(*, builds_on_meta: bool, background_saves: bool) -> RunContext:
    """The context of a run starting in this process; one at a time. The run starts without
    what earlier runs left in fairseq (forget_previous_runs)."""
    global _current
    if _current is not None:
        raise OptionError("an FSDP2 run is already in progress in this process: one run at a "
                          "time (start the next when the first has returned)")
    forget_previous_runs()
    _current = RunContext(builds_on_meta=builds_on_meta, background_saves=background_saves,
                          index=next(_runs))
    return _current


def current() -> Optional[RunContext]:
    """The FSDP2 run in progress in this process, or None (other backends, or between runs)."""
    return _current
