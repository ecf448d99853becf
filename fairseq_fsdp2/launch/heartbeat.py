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
from typing import Optional

import torch.distributed as dist

PREFIX = "fairseq_fsdp2/heartbeat/"
INTERVAL_S = 1.0
#: how many beats a live rank gets to show it is alive
CHECK_BEATS = 3

#: gloo/NCCL/store failures that mean a peer went away or stopped answering
PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                     "Timed out", "timed out", "Timeout", "Socket closed",
                     "NCCL communicator was aborted", "failed to recv", "failed to send")


class Heartbeat:
    """A daemon thread adding 1 to this rank's counter in the store every ``interval`` s."""

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 interval: float = INTERVAL_S):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.num_updates = 0  # set by the trainer: where training was when a peer was lost
        # a daemon: it beats until the process ends
        threading.Thread(target=self._beat, name="fsdp2-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        key = f"{PREFIX}{self.rank}"
        while True:
            try:
                self.store.add(key, 1)
            except Exception:  # the store is gone: the caller finds out at its next collective
                return
            time.sleep(self.interval)

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


_current: Optional[Heartbeat] = None


def start(rank: int, world_size: int) -> Optional[Heartbeat]:
    """Start this rank's heartbeat in the default group's store (None without a group)."""
    global _current
    if world_size < 2 or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store
    _current = Heartbeat(_get_default_store(), rank, world_size)
    return _current


def current() -> Optional[Heartbeat]:
    """This process's heartbeat, if training started one."""
    return _current


def set_collective_timeout(seconds: int, groups) -> None:
    """Make collectives on ``groups`` fail after ``seconds`` instead of torch's 30 minutes."""
    from torch.distributed.distributed_c10d import _set_pg_timeout
    for group in groups:
        _set_pg_timeout(timedelta(seconds=seconds), group)


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
