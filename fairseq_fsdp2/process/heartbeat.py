"""Which ranks are still alive: heartbeats in the rendezvous store.

When a rank dies, the others only see gloo's or NCCL's text ("Connection closed by peer
[10.0.0.3]:26496", or a timeout), which names an address, not a rank. Every rank therefore
counts heartbeats in the c10d store from a daemon thread; when a collective fails, a survivor
reads the counters twice, a few beats apart, and names the ranks whose counter stood still.
The counters are compared with themselves, never with a clock, so hosts need not agree on time.

If the store itself is gone, its host died: rank 0 for ``env://`` launches without an agent
(fairseq's spawn, the plugin's own single-node launch), or torchrun's agent.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

PREFIX = "fairseq_fsdp2/heartbeat/"
INTERVAL_S = 1.0
#: how many beats a live rank gets to show it is alive
CHECK_BEATS = 3
#: how long the end of a run waits for the heartbeat thread's last beat
STOP_TIMEOUT_S = 30.0

#: gloo/NCCL/store failures that mean a peer went away or stopped answering
PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                     "Timed out", "timed out", "Timeout", "Socket closed",
                     "NCCL communicator was aborted", "failed to recv", "failed to send")


class Heartbeat:
    """A thread adding 1 to this rank's counter in the store every ``interval`` s, until
    ``stop``.

    Why it must be stopped before the interpreter exits (not left to die as a daemon): CPython
    ends a daemon thread that wakes during finalization with ``pthread_exit``; a thread inside
    ``store.add`` (pybind11, the GIL released) then unwinds through pybind11's GIL guard, whose
    destructor is ``noexcept``, and the C++ runtime calls ``std::terminate``: "terminate called
    without an active exception", SIGABRT, a finished run reported as failed
    (docs/architecture.md, "The end of a run")."""

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 interval: float = INTERVAL_S):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.num_updates = 0  # set by the trainer: where training was when a peer was lost
        self._stopped = threading.Event()
        # a daemon only so that a run stopped without its teardown (os._exit after a lost rank)
        # is never held up by it; every other end of a run stops and joins it
        self._thread = threading.Thread(target=self._beat, name="fsdp2-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        key, store = f"{PREFIX}{self.rank}", self.store
        while not self._stopped.is_set():
            try:
                store.add(key, 1)
            except Exception:  # the store is gone: the caller finds out at its next collective
                return
            self._stopped.wait(self.interval)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Stop beating and wait for the thread (at most ``timeout`` s: a beat blocked on a dead
        store returns within the store's own timeout). True if the thread has ended."""
        self._stopped.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self.store = None  # the store's server (rank 0's, env://) goes with the process group
        return True

    def lost_ranks(self) -> Optional[list[int]]:
        """The other ranks whose heartbeat stopped; None when the store cannot be reached."""
        try:
            self.store.set_timeout(timedelta(seconds=max(5.0, 2 * self.interval)))
            first = self._counts()
            time.sleep(CHECK_BEATS * self.interval)
            second = self._counts()
        except Exception:
            return None
        return [r for r in range(self.world_size)
                if r != self.rank and second[r] == first[r]]

    def _counts(self) -> list[int]:
        # add(key, 0) reads a counter without blocking, and creates a missing one
        return [self.store.add(f"{PREFIX}{r}", 0) for r in range(self.world_size)]


def start(rank: int, world_size: int) -> Optional[Heartbeat]:
    """A heartbeat for this rank in the default group's store (None for one rank or without a
    group). The run context (run_context.py) keeps it and stops it at the end of the run."""
    if world_size < 2 or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store
    return Heartbeat(_get_default_store(), rank, world_size)


def set_collective_timeout(seconds: int, groups) -> Callable[[], None]:
    """Make collectives on ``groups`` fail after ``seconds`` instead of torch's 30 minutes;
    returns what puts each group's backends back to the timeout they had (for a caller's
    group, which outlives the run: run_context.RunContext.on_close). torch has no public
    getter or per-backend setter: its ``_set_pg_timeout`` sets every backend of a group (gloo
    on CPU, NCCL on GPUs) alike, and each backend's ``options._timeout`` holds its own."""
    from torch.distributed.distributed_c10d import _set_pg_timeout
    before = []
    for group in groups:
        for device in group._device_types:  # private, as _set_pg_timeout reads them
            backend = group._get_backend(device)
            timeout = getattr(getattr(backend, "options", None), "_timeout", None)
            if timeout is not None and all(b is not backend for b, _ in before):
                before.append((backend, timeout))
        _set_pg_timeout(timedelta(seconds=seconds), group)

    def restore() -> None:
        for backend, timeout in before:
            backend._set_default_timeout(timeout)
    return restore


def looks_like_peer_loss(error: BaseException) -> bool:
    """A communication failure (rather than a bug or bad input on this rank)."""
    while error is not None:
        if isinstance(error, dist.DistError) or (
                isinstance(error, RuntimeError)
                and any(m in str(error) for m in PEER_LOSS_MARKERS)):
            return True
        error = error.__cause__ or error.__context__
    return False


def describe_loss(beat: Heartbeat, save_dir: Optional[str]) -> str:
    """One line for the user: which rank was lost, where, and how to go on."""
    lost = beat.lost_ranks()
    if lost is None:
        who = ("lost the rendezvous store (torchrun's agent)" if _agent_store()
               else "lost rank 0 (it hosts the rendezvous store)")
    elif lost:
        who = f"lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}"
    else:
        who = "a collective failed although every rank still has a heartbeat"
    resume = (f"; run the same command again to resume from the last checkpoint in {save_dir}"
              if save_dir else "")
    return (f"{who} (rank {beat.rank} noticed at update {beat.num_updates + 1}): the job stops"
            f"{resume}")


def _agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
