"""Per-rank peak memory since the last log, gathered to rank 0 and logged.

Every rank's figures go to fairseq's metrics (``mem_peak_gb_max``, ``mem_peak_gb_min``,
``mem_peak_rank``; on CUDA also ``mem_reserved_gb_max`` and ``mem_alloc_retries``) and, in
full, to ``<save-dir>/memory.jsonl`` (one JSON line per log interval).

What "peak" means:
- CUDA: the caching allocator's peak allocated bytes (and peak reserved), reset each interval;
  ``alloc_retries``: the allocator's retries (cudaMalloc failed, cache freed, tried again) in
  the interval.
- CPU: the process's peak resident set size (VmHWM), reset each interval through
  ``/proc/self/clear_refs``; where that cannot be reset, the lifetime peak (``ru_maxrss``).
  Launch with ``MALLOC_MMAP_THRESHOLD_=65536`` (the scripts do) or glibc keeps freed memory
  and RSS creeps upward step after step.
"""
from __future__ import annotations

import json
import os
import resource
from typing import Callable, Optional

import torch
import torch.distributed as dist
from fairseq.logging import metrics

GB = 1024 ** 3


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak RSS (VmHWM) of this process
    except OSError:
        pass


def read_peak(device: torch.device) -> dict:
    """This process's peak memory since the last reset, in GiB."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"peak_gb": stats.get("allocated_bytes.all.peak", 0) / GB,
                "reserved_gb": stats.get("reserved_bytes.all.peak", 0) / GB}
    return {"peak_gb": _peak_rss_bytes() / GB, "reserved_gb": 0.0}


class IntervalCount:
    """A count per interval from a cumulative counter: the CUDA allocator's
    ``num_alloc_retries`` counts from the start of the process (``reset_peak_memory_stats``
    leaves it alone), so one interval's count is the difference of two readings."""

    def __init__(self, read: Callable[[], float]):
        self._read = read
        self._last = read()

    def take(self) -> float:
        """The count since the previous call (or since construction)."""
        now = self._read()
        count, self._last = now - self._last, now
        return count


def current_gb(device: torch.device) -> float:
    """Memory in use now: allocated on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / GB
    return _status_kb("VmRSS:") * 1024 / GB


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _peak_rss_bytes() -> int:
    return _status_kb("VmHWM:") * 1024 or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryMonitor:
    """Call ``log(num_updates)`` on every rank at each log interval."""

    def __init__(self, device: torch.device, jsonl_path: Optional[str], rank: int,
                 group: Optional[dist.ProcessGroup] = None):
        self.device = device
        self.jsonl_path = jsonl_path
        self.rank = rank
        self.group = group
        #: (update, every rank's figures) of the last log: what an out-of-memory report quotes
        self.last: Optional[tuple[int, list[dict]]] = None
        #: this process's peak before training (runtime, data, building the model), GiB
        self.startup_peak_gb = read_peak(device)["peak_gb"]
        reset_peak(device)
        self._retries = IntervalCount(
            lambda: float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
        ) if device.type == "cuda" else None

    def reset(self) -> None:
        reset_peak(self.device)

    def gather(self, extra: Optional[dict] = None) -> list[dict]:
        """Every rank's figures, on every rank (one small all-gather)."""
        mine = {**read_peak(self.device), **(extra or {})}
        keys = list(mine)
        local = torch.tensor([mine[k] for k in keys], dtype=torch.float64)
        if not (dist.is_available() and dist.is_initialized()):
            return [mine]
        world = dist.get_world_size(self.group)
        backend_device = self.device if dist.get_backend(self.group) == "nccl" else "cpu"
        local = local.to(backend_device)
        out = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(out, local, group=self.group)
        return [dict(zip(keys, t.cpu().tolist())) for t in out]

    def log(self, num_updates: int) -> list[dict]:
        per_rank = self.gather(
            {"alloc_retries": self._retries.take() if self._retries is not None else 0.0})
        reset_peak(self.device)
        self.last = (num_updates, per_rank)
        peaks = [r["peak_gb"] for r in per_rank]
        top = max(range(len(peaks)), key=peaks.__getitem__)
        metrics.log_scalar("mem_peak_gb_max", peaks[top], weight=0, priority=1500, round=3)
        metrics.log_scalar("mem_peak_gb_min", min(peaks), weight=0, priority=1501, round=3)
        metrics.log_scalar("mem_peak_rank", top, weight=0, priority=1502, round=0)
        if self.device.type == "cuda":
            metrics.log_scalar("mem_reserved_gb_max", max(r["reserved_gb"] for r in per_rank),
                               weight=0, priority=1503, round=3)
            metrics.log_scalar("mem_alloc_retries", sum(r["alloc_retries"] for r in per_rank),
                               weight=0, priority=1504, round=0)
        if self.rank == 0 and self.jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.jsonl_path)), exist_ok=True)
            record = {"num_updates": num_updates, "device": self.device.type,
                      "ranks": [dict(rank=i, **r) for i, r in enumerate(per_rank)]}
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return per_rank


def describe_last(monitor: MemoryMonitor) -> str:
    """Every rank's last logged peak, for an error message."""
    if monitor.last is None:
        return "no per-rank peak logged yet"
    update, per_rank = monitor.last
    return f"per-rank peak GB at update {update}: " + ", ".join(
        f"rank {i} {r['peak_gb']:.3f}" for i, r in enumerate(per_rank))
