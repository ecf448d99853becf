"""Sharded checkpoints written in the background (fairseq's ``--write-checkpoints-asynchronously``).

What: at a save point training goes on at once. Every rank copies its shards of the model and
optimizer state to CPU memory (the staging copy of DCP's ``async_save``, made by a thread while
the next update's forward and backward run; that update's optimizer step waits for it), then
DCP's background thread writes the copy to ``<shard dir>.tmp``. When every rank's shards are
written, rank 0 renames the directory and only then writes the fairseq checkpoint files that
name it (the first file, then the others fairseq copies it to, such as ``checkpoint_last.pt``),
each under a temporary name and renamed.

So a save stays atomic: no file ever names an incomplete directory (DCP's coordinator writes
``.metadata`` after gathering every rank's write results, and the rename follows), and a kill
during the background write leaves the previous checkpoint files and their shards as they were.
The next save point and the end of training wait for a pending save first (and report its
failure as one line); a save point never starts a second write. The staging copy is as large as
the rank's shards of the checkpoint (12 bytes per parameter / ranks with fp32 Adam) and is kept
from the first save to the end of the run: each save copies into it again.

Why a process group of its own (gloo, created at the first save): the background save runs
collectives (its plan, the gathering of write results); on the training group they would
interleave with FSDP2's all-gathers and reduce-scatters from the main thread. DCP's
asynchronous save needs a CPU backend for them in any case (NCCL runs FSDP2 on GPUs).

Why fairseq's own flag is switched off (``process/setup.py``): fairseq would write its file with
iopath's asynchronous writer (which leaves files torch cannot read back), would skip the copy to
``checkpoint_last.pt``, and would not train at all without iopath installed.
"""
from __future__ import annotations

import copy
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from fairseq import checkpoint_utils
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ..errors import SaveFailed, first_line, no_space_left
from . import sharded

logger = logging.getLogger(__name__)

#: how long the run's end waits for an abandoned save's thread (it may be writing a file)
ABANDON_JOIN_S = 60


class SaveAbandoned(Exception):
    """The run ended (after a failure) with this save in flight."""


def describe_failure(error: BaseException, save_dir: Optional[str] = None) -> str:
    """What a failed save reports; for DCP's CheckpointException, which wraps each rank's
    failure, the first failing rank's error. A full disk says so, with the free space of
    ``save_dir``'s file system (errors.no_space_left)."""
    full = no_space_left(error, save_dir) if save_dir else None
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items())
        return f"{full or first_line(cause, 300)} (rank {rank}'s write)"
    return full or first_line(error, 300)


def save_failed(update: int, save_dir: str, error: BaseException) -> SaveFailed:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return SaveFailed(f"saving the checkpoint of update {update} to {save_dir} failed on rank "
                      f"{rank}: {describe_failure(error, save_dir)}; the previous checkpoints "
                      f"are intact")


class ShardStager(AsyncStager):
    """The staging step of DCP's async_save (its public extension point): a copy of the state
    in CPU memory that training cannot change, each DTensor as a copy of its local shard on the
    same mesh, placements, shape and stride.

    The copy is made by a thread of its own while the next update's forward and backward run
    (they only read the parameters and do not touch the optimizer state); the optimizer's next
    step waits for it (``wait``, a step pre-hook that ``start`` installs), and DCP's write starts
    when it is done. The copies are kept and reused at the next save (its write is over by
    then): filling fresh memory (a page fault per page) took longer than the copy itself.
    Why not torch's default stager: it copies in the training loop, and it also deep-copies each
    DTensor's Python metadata (its mesh and placements), which took several times as long as
    copying the data (measured on the NLLB-shaped benchmark model, 270 tensors)."""

    _synchronize_after_execute = False  # async_save gets a Future: nothing to wait for here

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2-staging")
        self._copying: Optional[Future] = None

    def stage(self, state_dict) -> Future:
        """The staged state (tensors not yet filled) and, in the copier thread, their copy; the
        Future is done when the copies are."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = self._staged(state_dict, "", copies)
        kept = {path for path, _ in copies}
        self._buffers = {path: b for path, b in self._buffers.items() if path in kept}
        self._copying = self._copier.submit(_fill, [(self._buffers[p], t) for p, t in copies],
                                            staged)
        return self._copying

    def wait(self) -> None:
        """Until the last staging copy is complete (before anything changes what it copies)."""
        if self._copying is not None:
            self._copying.result()

    def _staged(self, value, path: str, copies: list):
        if isinstance(value, DTensor):
            return DTensor.from_local(self._buffer(value.to_local(), path, copies),
                                      value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._buffer(value, path, copies)
        if isinstance(value, dict):
            return {k: self._staged(v, f"{path}/{k}", copies) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._staged(v, f"{path}/{i}", copies)
                               for i, v in enumerate(value))
        return value

    def _buffer(self, tensor: torch.Tensor, path: str, copies: list) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[path] = torch.empty(tensor.shape, dtype=tensor.dtype,
                                                       device="cpu")
        copies.append((path, tensor.detach()))
        return buffer

    def close(self) -> None:
        pass  # AsyncStager's hook for DCP: the copies are kept for the next save

    def shut_down(self) -> None:
        """The run's end: the copier thread finishes its copy and ends."""
        self._copier.shutdown(wait=True)
        self._buffers = {}


def _fill(copies: list[tuple[torch.Tensor, torch.Tensor]], staged):
    with torch.no_grad():
        for buffer, source in copies:
            buffer.copy_(source)
    return staged


class PendingSave:
    """One save in flight: DCP writing this rank's staged shards, and on rank 0 the fairseq
    files that will name them once they are complete."""

    def __init__(self, update: int, save_dir: str, rel: str, is_writer: bool):
        self.update, self.save_dir, self.rel = update, save_dir, rel
        self._is_writer = is_writer
        self._shards: Future = Future()  # DCP's outcome, passed on by shards_done
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._files: list[tuple[str, dict]] = []  # (file name, state) in fairseq's order
        self._named = threading.Event()  # fairseq named a file, or the save point is over
        self._written = False
        self._abandoned = False
        self._error: Optional[BaseException] = None
        # started before DCP's thread: a thread started while that one plans the save (Python,
        # holding the GIL) waited seconds for its first turn, and the main thread with it
        self._thread = threading.Thread(target=self._finish, daemon=True,
                                        name=f"fsdp2-checkpoint-{update}")
        self._thread.start()

    def shards_done(self, shards: Future) -> None:
        """DCP's future for the shards (a done-callback): its outcome goes to ``_finish``."""
        with self._lock:
            if self._shards.done():  # abandoned first
                return
            if shards.exception() is not None:
                self._shards.set_exception(shards.exception())
            else:
                self._shards.set_result(shards.result())

    def abandon(self, timeout: float = ABANDON_JOIN_S) -> bool:
        """After a failure, at the run's end: the save's thread stops waiting (for DCP, whose
        collectives may never finish when a rank is gone, and for fairseq to name files) and
        writes no file; it is joined, so that no thread of the run outlives it (a daemon
        thread still running at interpreter exit can abort the process: process/heartbeat.py).
        Returns whether it ended within ``timeout`` seconds."""
        with self._lock:
            self._abandoned = True  # no file is written from now on
            if not self._shards.done():
                self._shards.set_exception(SaveAbandoned(f"update {self.update}"))
        self._named.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def add_file(self, filename: str, state: dict) -> None:
        """Rank 0: fairseq's checkpoint file for this save, written when the shards are."""
        with self._lock:
            self._files.append((filename, state))
        self._named.set()

    def defer_copy(self, src: str, dst: str) -> bool:
        """fairseq copies its first file to the others (checkpoint_last.pt, ...): if ``src`` is
        this save's file and not yet written, write ``dst`` with it (True); else copy now."""
        with self._lock:
            if self._written:
                return False
            for name, state in self._files:
                if os.path.abspath(name) == os.path.abspath(src):
                    self._files.append((dst, state))
                    return True
        return False

    def wait(self) -> None:
        """The save, whole: shards and files written (fairseq names no more files for it).
        Raises SaveFailed if any part failed, on any rank."""
        self._named.set()
        self._thread.join()
        if self._error is not None:
            raise save_failed(self.update, self.save_dir, self._error) from self._error

    def _finish(self) -> None:
        try:
            self._shards.result()
            if not self._is_writer:
                return
            final = os.path.join(self.save_dir, self.rel)
            os.rename(final + ".tmp", final)
            self._named.wait()
            with self._lock:
                if self._abandoned:
                    return
                for name, state in self._files:
                    checkpoint_utils.torch_persistent_save(state, name)  # .tmp, then renamed
                self._written = True
                names = [os.path.basename(name) for name, _ in self._files]
            if names:
                logger.info(f"wrote {', '.join(names)} (update {self.update}) in the "
                            f"background, {time.monotonic() - self._started:.1f} s after the "
                            f"save point")
        except BaseException as e:  # noqa: BLE001 - reported by wait(), in the main thread
            self._error = e


class BackgroundSaves:
    """One run's background saves (``--write-checkpoints-asynchronously``), owned by its run
    context (process/run_context.py), which closes it when the run ends: the save in flight,
    the process group of their collectives and the staging copies, reused from save to save."""

    def __init__(self) -> None:
        self._pending: Optional[PendingSave] = None  # the save in flight
        self._group: Optional[dist.ProcessGroup] = None  # the background saves' collectives
        self._stager: Optional[ShardStager] = None  # its copies are reused from save to save
        self._hooks: dict[int, object] = {}  # the optimizers whose step waits for the staging

    def start(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
              save_dir: str, update: int, stepping: torch.optim.Optimizer,
              timeout: Optional[timedelta] = None, extra: Optional[dict] = None) -> str:
        """Every rank, after ``wait_pending``: stage this rank's shards and write them in the
        background; returns the shard directory (relative to save_dir) that the files will
        name. ``optimizer``: whose state is saved (None: none); ``stepping``: the optimizer
        whose next step waits for the staging copy. ``timeout``: the background collectives'
        (--heartbeat-timeout), set when the first save creates their process group. ``extra``:
        more entries for the shards (the EMA's, written as staged: fairseq updates the EMA
        after the optimizer step, which waits for the staging copy)."""
        if self._pending is not None:
            raise RuntimeError("a background save is still pending: wait_pending() first")
        if self._group is None:  # every rank is here (a save point): a collective call
            self._group = dist.new_group(backend="gloo", timeout=timeout)
            self._stager = ShardStager()
        if id(stepping) not in self._hooks:
            self._hooks[id(stepping)] = stepping.register_step_pre_hook(self._wait_for_staging)
        rel = sharded.new_shard_dir(update)
        self._pending = PendingSave(update, save_dir, rel, is_writer=dist.get_rank() == 0)
        try:
            shards = dcp.async_save(sharded.state_to_save(model, optimizer, extra),
                                    checkpoint_id=os.path.join(save_dir, rel) + ".tmp",
                                    process_group=self._group,
                                    async_stager=self._stager).upload_completion
        except BaseException as e:  # e.g. staging ran out of memory: reported now, as a sync save
            failed: Future = Future()
            failed.set_exception(e)
            self._pending.shards_done(failed)
            raise
        shards.add_done_callback(self._pending.shards_done)
        return rel

    def add_file(self, filename: str, state: dict) -> None:
        """Rank 0: a fairseq checkpoint file of the pending save, written (a snapshot of
        ``state``, taken now) once its shards are complete."""
        if self._pending is None:
            raise RuntimeError("a checkpoint file without a pending background save")
        self._pending.add_file(filename, copy.deepcopy(state))

    def wait_pending(self) -> None:
        """Wait for the pending save, if any (next save point, end of training); raises
        SaveFailed if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def defer_copy(self, src_path: str, dst_path: str) -> bool:
        """fairseq's PathManager.copy (integration/registration.py): True if ``src_path`` is a
        file the pending save has not written yet; the copy is then written with it."""
        return self._pending is not None and self._pending.defer_copy(src_path, dst_path)

    def close(self) -> None:
        """The end of the run (after ``wait_pending``, or after a failure): no step waits for
        staging any more, the staging thread ends, and the saves' process group is destroyed.
        A save still in flight after a failure is abandoned (its directory stays ``.tmp``, never
        named by a checkpoint file) and its thread joined."""
        pending, self._pending = self._pending, None
        if pending is not None and not pending.abandon():
            logger.warning("the background save's thread did not stop within %d s; it ends "
                           "with the process", ABANDON_JOIN_S)
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        if self._stager is not None:
            self._stager.shut_down()
            self._stager = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    def _wait_for_staging(self, optimizer, args, kwargs) -> None:
        """Step pre-hook: the staging copy first (the step changes what it copies)."""
        if self._stager is not None:
            self._stager.wait()
