"""Imported by a benchmark's ranks first (worker.py's ``--import=``, as async_save_timers.py):
times each update (fairseq's ``Trainer.train_step``, which FSDP2Trainer calls through
``super()``) and, within it, the optimizer's step (``FairseqOptimizer.step``: Adam's update with
its moments widened and stored again, adam_stats.py; fp16's ``MemoryEfficientFP16Optimizer``
calls it too, so only the outermost call counts), and prints one ``UPDATE {json}`` line per
update: rank, update number, seconds and optimizer-step seconds, each as wall time and as this
process's CPU time (``time.process_time``: what the rank computed, whatever else the machine
ran meanwhile; waits in collectives sleep, and do not count). Reads no memory figure: the
benchmark measures the peak from outside (GNU time)."""
from __future__ import annotations

import json
import os
import time

from fairseq.optim.fairseq_optimizer import FairseqOptimizer
from fairseq.trainer import Trainer

#: the line prefix adam_stats_600m.py reads (it does not import this module, which patches)
PREFIX = "UPDATE "


def install() -> None:
    rank = int(os.environ.get("RANK", "0"))
    spent = {"optimizer_s": 0.0, "optimizer_cpu_s": 0.0, "depth": 0}
    real_step, real_optimizer_step = Trainer.train_step, FairseqOptimizer.step

    def optimizer_step(self, *args, **kwargs):
        spent["depth"] += 1
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return real_optimizer_step(self, *args, **kwargs)
        finally:
            spent["depth"] -= 1
            if not spent["depth"]:
                spent["optimizer_s"] += time.perf_counter() - t0
                spent["optimizer_cpu_s"] += time.process_time() - c0

    def train_step(self, samples, raise_oom=False):
        spent["optimizer_s"] = spent["optimizer_cpu_s"] = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        out = real_step(self, samples, raise_oom)
        print(PREFIX + json.dumps({"rank": rank, "update": self.get_num_updates(),
                                   "s": time.perf_counter() - t0,
                                   "cpu_s": time.process_time() - c0,
                                   "optimizer_s": spent["optimizer_s"],
                                   "optimizer_cpu_s": spent["optimizer_cpu_s"]}), flush=True)
        return out

    Trainer.train_step = train_step
    FairseqOptimizer.step = optimizer_step


install()
