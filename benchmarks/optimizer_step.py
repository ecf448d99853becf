"""The CPU time of the optimizer's part of an update on FSDP2 parameters (not a test): fairseq's
``multiply_grads``, the global-norm clipping and fairseq's Adam step, done through DTensor
dispatch (the path before optimizer/local_shard_step.py) and on the local shards (the plugin's
path), side by side in one process, interleaved, medians; optionally also the local shards with
Adam's moments in 16 or 8 bits (optimizer/adam_stats.py; 8 bits only for weights of at least
4096 elements: ``--elements 4096`` or more, else they keep float32 moments).

The cost measured is per tensor operation, not per element: the default tensor count is
NLLB-600M's parameter tensor count (509: 12 + 12 layers, the shared embedding, 2 final layer
norms; their sizes add up to its 615,073,792 parameters) and each tensor is kept small so that
the arithmetic does not hide it, as on a GPU, where it runs asynchronously and the CPU's
dispatch is what the step waits for. One rank (gloo): DTensor's dispatch costs the same at any
world size. scripts/benchmark_optimizer_step.py parses the arguments.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from fairseq.optim.adam import FairseqAdamConfig
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fairseq_fsdp2.optimizer.build import build_optimizer

NLLB_600M_TENSORS = 509


def model(tensors: int, elements: int) -> nn.Module:
    """``tensors`` parameter tensors of ``elements`` elements (weights and biases of
    ``elements``-to-1 linear layers), each layer and the whole sharded."""
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(elements, 1) for _ in range(tensors // 2)))
    for layer in layers:
        fully_shard(layer)
    return fully_shard(layers)


def optimizer(params, dtensor_path: bool, stats: str = "fp32"):
    adam = OmegaConf.structured(FairseqAdamConfig(_name="adam", lr=[1e-3], tpu=False,
                                                  fp16_adam_stats=stats == "fp16"))
    cfg = OmegaConf.create({"common": {"fp16": False}, "optimizer": adam,
                            "distributed_training": {"bf16_adam_stats": stats == "bf16",
                                                     "eight_bit_adam_stats": stats == "8bit"}})
    # dtensor_path: what the plugin did before local_shard_step.py
    return build_optimizer(cfg, params, local_shards=not dtensor_path)


def main(tensors: int, elements: int, steps: int, adam_stats: str | None = None) -> None:
    """Time ``steps`` optimizer steps of each path (one rank, gloo) and print the medians;
    ``adam_stats`` ("fp16", "bf16", "8bit") adds the local shards with 16-bit or 8-bit
    moments."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    init_device_mesh("cpu", (1,))
    runs = {}
    paths = [("DTensor dispatch", True, "fp32"), ("local shards", False, "fp32")]
    if adam_stats:
        paths.append((f"local shards, {adam_stats} moments", False, adam_stats))
    for name, dtensor_path, stats in paths:
        m = model(tensors, elements)
        params = list(m.parameters())
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        runs[name] = (params, optimizer(params, dtensor_path, stats), [])
    for _ in range(steps):
        for name, (params, opt, times) in runs.items():
            start = time.perf_counter()
            opt.multiply_grads(0.5)
            opt.clip_grad_norm(1.0)
            opt.step()
            times.append(time.perf_counter() - start)
    med = {name: statistics.median(times[1:]) for name, (_, _, times) in runs.items()}
    print(f"{tensors} parameter tensors of {elements} elements, {steps} steps (first dropped), "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.2f}")
    for name, t in med.items():
        print(f"{name}: median {t * 1000:.1f} ms per update's optimizer work")
    print(f"local shards: {med['DTensor dispatch'] / med['local shards']:.1f}x faster")
    if adam_stats:
        name = f"local shards, {adam_stats} moments"
        print(f"{name}: {med[name] / med['local shards']:.2f}x the time of float32 moments")
    dist.destroy_process_group()
