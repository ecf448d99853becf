"""One rank of the 16-bit Adam state's checkpoint check (tests/test_adam_stats.py), on gloo.

argv: MODE DIR.
- ``save`` (2 ranks): a small sharded model per moment format (fp32, fp16, bf16, 8bit: its two
  weights, 20 x 300 and 230 x 20, big enough for 8 bits; uneven rows at 3 ranks), 3 Adam steps
  each, saved with the plugin's sharded checkpoint (checkpoint/sharded.py) to DIR/<format>;
  rank 0 writes each state's full tensors to DIR/<format>.pt. Prints one ``PROBE {json}`` line:
  per format, every random stream the steps drew from (``recording_streams``), all ranks'.
- ``load`` (3 ranks: other shards, uneven): each saved state loaded, as the trainer loads it,
  into an optimizer of each format that the test names, then one step with zero gradients. Prints one ``PROBE {json}``
  line: per (saved, run) pair, whether the loaded tensors equal the saved ones bit for bit,
  the dtypes and keys as loaded and after the step, and whether the step computed from the
  saved values (Adam's zero-gradient step: m x beta1, v x beta2, exact in float32).
"""
import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from fairseq.optim.adam import FairseqAdamConfig
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from probe_report import report_and_exit

from fairseq_fsdp2.checkpoint import sharded
from fairseq_fsdp2.optimizer import adam_stats, row_chunk_step
from fairseq_fsdp2.optimizer.moments.blockwise_8bit import dequantize
from fairseq_fsdp2.optimizer.moments.eight_bit import ABSMAX_KEYS, SIGNED
from fairseq_fsdp2.optimizer.moments.format import MOMENTS
from fairseq_fsdp2.optimizer.moments.sixteen_bit import SCALE_KEYS
from fairseq_fsdp2.optimizer.build import build_optimizer

FORMATS = ("fp32", "fp16", "bf16", "8bit")
BETAS = (0.9, 0.999)
#: (saved format, run format) pairs the load checks
PAIRS = [("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "fp16"),
         ("bf16", "fp16"), ("8bit", "8bit"), ("8bit", "fp32"), ("fp32", "8bit"), ("fp16", "8bit")]


def model(mesh) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(300, 20), nn.Tanh(), nn.Linear(20, 230))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def optimizer(params, stats: str):
    adam = OmegaConf.structured(FairseqAdamConfig(
        _name="adam", lr=[1e-2], adam_betas=BETAS, tpu=False, fp16_adam_stats=stats == "fp16"))
    cfg = OmegaConf.create({"common": {"fp16": False, "seed": 1},
                            "distributed_training": {"bf16_adam_stats": stats == "bf16",
                                                     "eight_bit_adam_stats": stats == "8bit"},
                            "optimization": {"update_freq": [1]}, "optimizer": adam})
    return build_optimizer(cfg, params).optimizer  # the torch optimizer


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def effective(state: dict) -> dict:
    """The moments' float32 values: the stored tensor times its scale (fp16), or its codes'
    values times their block maxima (8 bits)."""
    out = {}
    for key in MOMENTS:
        if ABSMAX_KEYS[key] in state:
            out[key] = dequantize(full(state[key]), full(state[ABSMAX_KEYS[key]]), SIGNED[key])
            continue
        value = full(state[key]).float()
        scale = state.get(SCALE_KEYS[key])
        out[key] = value * full(scale) if scale is not None else value
    return out


#: the 64-bit draws recorded from the start of each random stream
FIRST_DRAWS = 4


@contextlib.contextmanager
def recording_streams(streams: list):
    """Every generator the optimizer's stochastic rounding makes (generator_for, as the
    row-chunked step and the bucketed one call it) appended to ``streams`` as [its seed, its
    first FIRST_DRAWS 64-bit draws (from a generator made alike, so the step's own draws are
    untouched)]."""
    real = row_chunk_step.generator_for
    assert adam_stats.generator_for is real

    def recorded(device, seed):
        first = torch.empty(FIRST_DRAWS, dtype=torch.int64).random_(
            -1 << 63, None, generator=real(device, seed))
        streams.append([seed, first.tolist()])
        return real(device, seed)
    row_chunk_step.generator_for = adam_stats.generator_for = recorded
    try:
        yield streams
    finally:
        row_chunk_step.generator_for = adam_stats.generator_for = real


def save(root: str) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    report = {}
    for stats in FORMATS:
        m = model(mesh)
        params = dict(m.named_parameters())
        opt = optimizer(list(params.values()), stats)
        streams: list = []
        for step in range(3):
            opt.zero_grad()
            torch.manual_seed(100 + step)
            (m(torch.randn(7, 300) * 10 ** step).square().sum()).backward()
            with recording_streams(streams):
                opt.step()
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, streams)
        report[stats] = {"streams": every_rank, "steps": 3,
                         "shapes": {name: list(p.shape) for name, p in params.items()}}
        sharded.save(m, opt, f"{root}/{stats}", 3)
        saved = {name: {k: full(v) for k, v in opt.state[p].items() if torch.is_tensor(v)}
                 for name, p in params.items()}
        if dist.get_rank() == 0:
            torch.save(saved, f"{root}/{stats}.pt")
        dist.barrier()
    return report


def load_as_the_trainer_does(m: nn.Module, opt, shard_dir: str) -> None:
    """trainer/checkpoint_hooks.py: fairseq calls the optimizer's load_state_dict with a small
    stub; a pre-hook reads the shards (which loads the optimizer once more, inside) and hands
    on the optimizer's state, which torch's load_state_dict then loads again."""
    def read_shards(optimizer, state_dict):
        if "shards" not in state_dict:
            return None
        sharded.load_optimizer(m, optimizer, state_dict["shards"])
        return optimizer.state_dict()
    opt.register_load_state_dict_pre_hook(read_shards)
    opt.load_state_dict({"shards": shard_dir})


def load(root: str) -> dict:
    import os
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    report = {}
    for saved_stats, run_stats in PAIRS:
        m = model(mesh)
        params = dict(m.named_parameters())
        opt = optimizer(list(params.values()), run_stats)
        shard_dir = f"{root}/{saved_stats}"
        shard_dir = os.path.join(shard_dir, os.listdir(shard_dir)[0], os.listdir(
            os.path.join(shard_dir, os.listdir(shard_dir)[0]))[0])
        load_as_the_trainer_does(m, opt, shard_dir)
        want = torch.load(f"{root}/{saved_stats}.pt", weights_only=True)
        loaded = {name: {k: full(v) for k, v in opt.state[p].items() if torch.is_tensor(v)}
                  for name, p in params.items()}
        before = {name: effective(opt.state[p]) for name, p in params.items()}
        for p in params.values():
            p.grad = torch.zeros_like(p)
        opt.step()
        after = {name: opt.state[p] for name, p in params.items()}
        b1, b2 = BETAS
        report[f"{saved_stats}->{run_stats}"] = {
            "bits_equal": all(set(loaded[n]) == set(want[n]) and all(
                loaded[n][k].dtype == want[n][k].dtype and torch.equal(loaded[n][k], want[n][k])
                for k in want[n]) for n in want),
            "loaded_dtypes": sorted({str(loaded[n][k].dtype) for n in loaded for k in MOMENTS}),
            "after_dtypes": sorted({str(after[n][k].dtype) for n in after for k in MOMENTS}),
            "after_keys": sorted({k for n in after for k in after[n]}),
            "after_is_dtensor": all(isinstance(after[n][k], DTensor) for n in after
                                    for k in MOMENTS),
            # the step computed from what was saved: float32 m x beta1 and v x beta2 (the
            # zero gradient adds exact zeros), then stored in the run's format; the largest
            # difference relative to each tensor's largest element
            "after_max_rel": max(((effective(after[n])[k] - before[n][k] * beta).abs().max() /
                                  (before[n][k] * beta).abs().max()).item()
                                 for n in after for k, beta in zip(MOMENTS, (b1, b2))),
            "min_peak": min((before[n][k] * beta).abs().max().item()
                            for n in after for k, beta in zip(MOMENTS, (b1, b2))),
        }
    return report


def main() -> None:
    mode, root = sys.argv[1:3]
    dist.init_process_group("gloo")
    if mode == "save":
        report_and_exit(save(root), print_here=dist.get_rank() == 0)
    report_and_exit(load(root), print_here=dist.get_rank() == 0)


if __name__ == "__main__":
    main()
