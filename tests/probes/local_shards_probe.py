"""One rank of the local-shard optimizer check (tests/test_local_shards.py), on gloo. Prints one
``PROBE {json}`` line.

Two copies of a small model (rows that do not divide evenly over 2 ranks, a bias, a weight
decay that touches every element) are sharded with FSDP2 and trained 4 steps on the same
batches, with Adam's moments in float32, and in fp16 (--fp16-adam-stats: per-tensor scales from
an all-reduce of the shards' maxima) and bf16 (stochastic rounding) between steps, and in 8
bits (--eight-bit-adam-stats, a wider model: WIDTHS). The reference is the plugin's optimizer
built with ``local_shards=False`` (fairseq's
``multiply_grads``, torch's clipping and fairseq's Adam on the DTensors, through DTensor
dispatch); the other is the plugin's optimizer as training builds it, which does that work on
the local shards; both also under fairseq's fp16 wrapper (loss scaling, deferred unscaling).
Every parameter and every state tensor must be bit-identical.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from fairseq.optim.adafactor import Adafactor
from fairseq.optim.adam import FairseqAdamConfig
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from probe_report import report_and_exit

from fairseq_fsdp2.optimizer.build import build_optimizer
from fairseq_fsdp2.optimizer.local_shard_step import LocalShardStep, use_local_shards

MAX_NORM = 0.5
STEPS = 4


#: the model's widths (input, hidden, output); 8 bits: weights of 21 x 300 and 230 x 21, large
#: enough for 8-bit moments (blocks of 256 and 44 in the first's rows; 21 rows: 11 and 10)
WIDTHS = {"small": (6, 5, 3), "8bit": (300, 21, 230)}


def model(mesh, widths=WIDTHS["small"]) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(*widths[:2]), nn.Tanh(), nn.Linear(*widths[1:]))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def cfg(fp16: bool, stats: str = "fp32"):
    adam = OmegaConf.structured(FairseqAdamConfig(
        _name="adam", lr=[1e-2], weight_decay=0.01, tpu=False,
        fp16_adam_stats=stats == "fp16"))
    return OmegaConf.create({  # what fairseq's fp16 wrapper reads
        "common": {"fp16": fp16, "fp16_init_scale": 8, "fp16_scale_window": None,
                   "fp16_scale_tolerance": 0.0, "threshold_loss_scale": None,
                   "min_loss_scale": 1e-4, "model_parallel_size": 1, "seed": 1},
        "distributed_training": {"distributed_world_size": dist.get_world_size(),
                                 "bf16_adam_stats": stats == "bf16",
                                 "eight_bit_adam_stats": stats == "8bit"},
        "optimization": {"update_freq": [1]}, "optimizer": adam})


def backward(m: nn.Module, step: int, scale: float) -> None:
    torch.manual_seed(100 + step)  # the same batch on every rank and for both models
    (m(torch.randn(7, m[0].in_features) * 3).square().sum() * scale).backward()


def torch_optimizer(optimizer):
    inner = optimizer.wrapped_optimizer if hasattr(optimizer, "wrapped_optimizer") else optimizer
    return inner.optimizer


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def run(fp16: bool, stats: str = "fp32") -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    widths = WIDTHS["8bit" if stats == "8bit" else "small"]
    reference, ours = model(mesh, widths), model(mesh, widths)
    ref_params, our_params = list(reference.parameters()), list(ours.parameters())
    ref_opt = build_optimizer(cfg(fp16, stats), ref_params, local_shards=False)
    our_opt = build_optimizer(cfg(fp16, stats), our_params)
    for step in range(STEPS):
        for m, opt in ((reference, ref_opt), (ours, our_opt)):
            opt.zero_grad()
            backward(m, step, opt.scaler.loss_scale if fp16 else 1.0)
            opt.multiply_grads(0.7)
            opt.clip_grad_norm(MAX_NORM)
            opt.step()
    torch_opt = torch_optimizer(our_opt)
    ref_state = [torch_optimizer(ref_opt).state[p] for p in ref_params]
    our_state = [torch_opt.state[p] for p in our_params]
    return {
        "local_path": isinstance(torch_opt, LocalShardStep),
        "reference_local_path": isinstance(torch_optimizer(ref_opt), LocalShardStep)
        or getattr(ref_opt, "wrapped_optimizer", ref_opt).local_shards,
        "class_name": type(torch_opt).__name__,
        "param_max_diff": max((a.full_tensor() - b.full_tensor()).abs().max().item()
                              for a, b in zip(ref_params, our_params)),
        "params_moved": min((a.full_tensor() - b.full_tensor()).abs().max().item()
                            for a, b in zip(our_params, model(mesh, widths).parameters())),
        "state_keys_equal": all(set(a) == set(b) for a, b in zip(ref_state, our_state)),
        "state_max_diff": max((full(a[k]).float() - full(b[k]).float()).abs().max().item()
                              for a, b in zip(ref_state, our_state)
                              for k in a if torch.is_tensor(a[k])),
        "state_steps": sorted({b["step"] for b in our_state}),
        # the moments (the scales are plain scalars, the same on every rank)
        "state_is_dtensor": all(isinstance(b[k], DTensor) and b[k].placements == p.placements
                                for b, p in zip(our_state, our_params)
                                for k in b if torch.is_tensor(b[k]) and b[k].dim()),
        "state_dtypes": sorted({str(b[k].dtype) for b in our_state
                                for k in ("exp_avg", "exp_avg_sq")}),
        "state_keys": sorted({k for b in our_state for k in b}),
    }


def main() -> None:
    dist.init_process_group("gloo")
    adafactor = Adafactor([nn.Parameter(torch.ones(2))], lr=1e-2, relative_step=False)
    report = {"fp32": run(False), "fp16_wrapper": run(True),
              "fp16_adam_stats": run(True, "fp16"), "bf16_adam_stats": run(False, "bf16"),
              "eight_bit_adam_stats": run(False, "8bit"),
              "adafactor_local_path": use_local_shards(adafactor)}
    report_and_exit(report)


if __name__ == "__main__":
    main()
