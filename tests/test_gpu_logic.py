"""The GPU path's logic, on CPU (issue 13): what can be proven without a GPU.

- the gradient norm is the global one over DTensor gradients, whatever fairseq's helper does
  (apex emulated), with and without CPU offload; clipping matches the unsharded model;
- a full state dict is broadcast on the device the group's backend moves, then lands in the
  shards (gloo here; the NCCL choice is checked as logic);
- with apex installed fairseq would build apex's FusedAdam (emulated): the plugin keeps
  fairseq's own Adam, which works on DTensors;
- the allocator's retry count is per interval (two readings of a cumulative counter);
- a meta-built model with offloaded shards keeps its buffers on the compute device;
The same paths on a real GPU: tests/test_cuda.py. Ranks a process starts itself (fairseq's
per-GPU spawn, SLURM's one task per node) run the plugin's launch path: tests/test_launchers.py.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from fairseq import optim
from fairseq.optim.adam import FairseqAdamConfig
from omegaconf import OmegaConf

from conftest import REPO
from launcher import ok, run_ranks

from fairseq_fsdp2.optimizer.build import build_optimizer
from fairseq_fsdp2.sharding import meta_build
from fairseq_fsdp2.sharding.mesh import comm_device
from fairseq_fsdp2.memory.monitor import IntervalCount

PROBES = str(REPO / "tests" / "probes")


@pytest.fixture(scope="module")
def norm_report():
    out = ok(run_ranks(2, lambda r: [], module="norm_probe", env={"PYTHONPATH": PROBES}))
    return json.loads(next(line for line in out.splitlines()
                           if line.startswith("PROBE "))[6:])


@pytest.mark.parametrize("mode", ["plain", "offload"])
def test_norm_is_global_over_dtensor_grads_whatever_fairseq_helper_does(norm_report, mode):
    r = norm_report[mode]
    # fp32 throughout; the sharded norm sums the same squares in another order: float32
    # rounding, a few ulps of a value of order 10-1000
    assert r["norm"] == pytest.approx(r["expected"], rel=1e-5)
    assert not r["norm_is_dtensor"]
    # the local shards' way (optimizer/grad_norm.py) computes what DTensor's get_total_norm computes, in
    # the same order: per-tensor norms reduced over the ranks, then their norm (bit for bit)
    assert r["norm"] == r["dtensor_norm"], r
    # under the apex emulation fairseq's helper sees rank 0's shards only: the test bites
    assert abs(r["fairseq_norm"] - r["expected"]) > 1e-3 * r["expected"]
    # clipped gradients = the unsharded model's, clipped by torch's own clip_grad_norm_
    # (same float32 rounding; the clipped gradients have norm 0.5)
    assert r["clipped_max_diff"] < 1e-6
    # the offload case really ran FSDP2's CPU offload (on CPU the devices cannot tell: all
    # are the CPU); the device moves themselves are checked as logic in
    # test_comm_device_follows_the_backend and on GPUs in tests/test_cuda.py
    assert r["offload_policies"] == (["CPUOffloadPolicy"] if mode == "offload"
                                     else ["OffloadPolicy"]), r["offload_policies"]


@pytest.mark.parametrize("mode", ["plain", "offload"])
def test_full_state_broadcast_fills_the_shards_exactly(norm_report, mode):
    assert norm_report[mode]["broadcast_max_diff"] == 0.0  # copies only: bit-exact


def test_comm_device_follows_the_backend(monkeypatch):
    for backend, device in (("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert comm_device().type == device, backend


def test_apex_fused_adam_is_not_used_for_dtensor_params(monkeypatch):
    """Emulates apex being installed on a CUDA machine (neither exists here): fairseq's
    FairseqAdam would then build apex's FusedAdam, whose kernels take plain CUDA tensors."""
    built = []

    class EmulatedFusedAdam(torch.optim.Adam):
        def __init__(self, params, use_fp16_stats=False, **kwargs):
            built.append(True)
            super().__init__(params, lr=kwargs["lr"])

    monkeypatch.setattr("fairseq.optim.adam.get_fused_adam_class", lambda: EmulatedFusedAdam)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = OmegaConf.create({"common": {"fp16": False},
                            "optimizer": OmegaConf.structured(FairseqAdamConfig(_name="adam", lr=[1e-3], tpu=False))})
    params = list(nn.Linear(2, 2).parameters())
    optim.build_optimizer(cfg.optimizer, params)
    assert built == [True]  # stock fairseq under the emulation: the fused class
    ours = build_optimizer(cfg, params)
    assert built == [True] and type(ours.optimizer).__module__ == "fairseq.optim.adam"
    assert cfg.optimizer.use_old_adam is False  # the user's cfg (saved in checkpoints) unchanged


def test_alloc_retries_are_counted_per_interval():
    readings = iter([3.0, 3.0, 7.0, 7.0, 12.0])  # a cumulative counter, as the allocator's
    count = IntervalCount(lambda: next(readings))
    assert [count.take() for _ in range(4)] == [0.0, 4.0, 0.0, 5.0]


def test_meta_built_offloaded_model_keeps_buffers_on_the_compute_device():
    """--cpu-offload: the shards go to the CPU, buffers (positions, masks) stay where the
    forward runs. 'meta' stands in for the GPU here (a device other than the CPU)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
        model.register_buffer("table", torch.zeros(3))
    meta_build.materialize(model, torch.device("meta"), params_device=torch.device("cpu"))
    assert model[0].weight.device.type == "cpu" and model.table.device.type == "meta"
