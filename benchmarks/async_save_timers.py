"""The rank side of the asynchronous-checkpoint benchmark (async_save_run.py): importing this
module, as the benchmark worker does first (``--import=``), times fairseq's save_checkpoint, the
plugin's wait for a pending save, the optimizer step's wait for the staging copy and each
update, and prints one ``SAVE``/``WAIT``/``STEP {json}`` line each."""
from __future__ import annotations

import json
import os
import time

import fairseq.checkpoint_utils as checkpoint_utils
from fairseq.trainer import Trainer

from fairseq_fsdp2.checkpoint import async_save, sharded

GIB = 2 ** 30


def install() -> None:
    """Time fairseq's save_checkpoint, the plugin's wait for a pending save and each update;
    print one ``SAVE {json}`` / ``WAIT {json}`` / ``STEP {json}`` line each."""

    rank = int(os.environ["RANK"])
    waited = {"s": 0.0, "staging": 0.0}
    real_save, real_wait = checkpoint_utils.save_checkpoint, async_save.BackgroundSaves.wait_pending
    real_staging_wait = async_save.ShardStager.wait

    def staging_wait(self):  # the optimizer step's wait for the staging copy
        t0 = time.perf_counter()
        real_staging_wait(self)
        waited["staging"] += time.perf_counter() - t0

    def wait_pending(self):
        t0 = time.perf_counter()
        real_wait(self)
        waited["s"] += time.perf_counter() - t0
        print("WAIT " + json.dumps({"rank": rank, "s": time.perf_counter() - t0}), flush=True)

    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        waited["s"], t0 = 0.0, time.perf_counter()
        out = real_save(cfg, trainer, epoch_itr, val_loss)
        blocked = time.perf_counter() - t0
        state = sharded.state_to_save(trainer.model, trainer.optimizer.optimizer)
        print("SAVE " + json.dumps({
            "rank": rank, "update": trainer.get_num_updates(), "blocked_s": blocked,
            "waited_s": waited["s"], "shards_gb": tensor_bytes(state) / GIB}), flush=True)
        return out

    real_step = Trainer.train_step

    def train_step(self, samples, raise_oom=False):
        t0 = time.perf_counter()
        waited["staging"] = 0.0
        out = real_step(self, samples, raise_oom)
        print("STEP " + json.dumps({"rank": rank, "update": self.get_num_updates(),
                                    "s": time.perf_counter() - t0, "rss_gb": rss_gb(),
                                    "staging_wait_s": waited["staging"]}), flush=True)
        return out

    Trainer.train_step = train_step  # FSDP2Trainer calls it through super()
    checkpoint_utils.save_checkpoint = save_checkpoint
    async_save.BackgroundSaves.wait_pending = wait_pending
    async_save.ShardStager.wait = staging_wait


def rss_gb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2 ** 20
    return 0.0


def tensor_bytes(value) -> int:
    """This rank's bytes of the tensors in ``value`` (a DTensor: its local shard)."""
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    local = getattr(value, "to_local", None)
    tensor = local() if local else value
    return tensor.numel() * tensor.element_size() if hasattr(tensor, "element_size") else 0


install()
