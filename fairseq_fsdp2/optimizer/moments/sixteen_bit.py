"""Moments in 16 bits: fp16 with fairseq's scales (``--fp16-adam-stats``, fairseq's flag) and
bf16 rounded stochastically (``--bf16-adam-stats``, the plugin's): 2 bytes an element, half of
fairseq's float32 moments.

fp16, as fairseq's FusedAdamV1 keeps them (fairseq/optim/fused_adam.py; stock fairseq has the
flag with that CUDA optimizer only): after each step a moment is stored divided by its scale,
``1e-8 + max|moment| / 65504``, so that its largest element sits at fp16's largest finite value
and small ones stay clear of fp16's underflow; the scale (a float32 scalar) is stored beside it
under fairseq's keys (``exp_avg_scale``, ``exp_avg_sq_scale``), and the next step multiplies it
back. The maximum is the whole tensor's, as in fairseq: each rank's shard maximum, then an
all-reduce (max, one per bucket of parameters: optimizer/adam_stats.py); so the state means the
same thing at any world size and DCP reshards it as it is (the fp16 tensor cut like the
parameter; the scales the same everywhere). A chunk of rows cannot be stored on its own
(``narrows_rows``): its scale needs the whole tensor stepped first.

bf16: bf16 has float32's exponent range, so no scale; its 8-bit significand is rounded
stochastically (stochastic_round.py says why: rounded to nearest, the second moment could never
decrease), from the generator the step gives (seeded by the run's ``--seed``, the step, the
parameter's place, the moment and the shard's place, so a resumed run draws what the
uninterrupted run drew).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...sharding.mesh import comm_device, local_part
from .blockwise_8bit import abs_max
from .format import MomentFormat, like, shard_dims
from .stochastic_round import to_bf16_stochastic

#: fairseq's FusedAdamV1: scale = SCALE_FLOOR + max|moment| / FP16_MAX
FP16_MAX = 65504.0
SCALE_FLOOR = 1e-8
#: fp16: the float32 scale of each moment, under fairseq's keys
SCALE_KEYS = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}


class SixteenBit(MomentFormat):
    """Widened by a cast (exact), times the scale where one is stored."""

    element_bytes = 2
    widened_bytes = 4

    def widen(self, stored, side, key, out=None):
        wide = stored.float() if out is None else out.copy_(stored)
        return wide if side is None else wide.mul_(side)


class Fp16(SixteenBit):
    name = "fp16"
    dtype = torch.float16
    side_keys = SCALE_KEYS
    narrows_rows = False

    def narrow(self, wide, key, generator=None, dest=None, side=None):
        scaled = wide.div_(side)  # fairseq: (exp_avg / scale).half(); on DTensors by dispatch
        if dest is None:
            return scaled.half(), side
        return dest.copy_(scaled), side  # copy_ rounds to nearest, as half() does

    def whole_sides(self, wides, template, local_shards):
        """fairseq's scale of each moment: 1e-8 + max|moment| / 65504, the maximum over the
        whole tensor (float32 scalars, the same on every rank): each rank's, then one
        all-reduce for all of ``wides`` (parameters laid out alike)."""
        if not local_shards:  # fairseq: torch.norm(t, inf), through DTensor dispatch
            peaks = torch.stack([_full(torch.norm(m, float("inf"))) for m in wides])
        else:
            locals_ = [local_part(m) for m in wides]
            peaks = torch.stack([abs_max(m) if m.numel() else
                                 m.new_zeros(()) for m in locals_])
            if isinstance(template, DTensor):
                for dim in shard_dims(template):  # over the shards (HSDP replicas agree)
                    group = template.device_mesh.get_group(dim)
                    peaks = peaks.to(comm_device(group))
                    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
                peaks = peaks.to(locals_[0].device)
        scales = SCALE_FLOOR + peaks / FP16_MAX
        return [s.clone() for s in scales.unbind()]  # each saved on its own

    def placeholder(self, value):
        return torch.ones((), device=local_part(value).device)


class Bf16(SixteenBit):
    name = "bf16"
    dtype = torch.bfloat16
    draws = True

    def narrow(self, wide, key, generator=None, dest=None, side=None):
        out = to_bf16_stochastic(local_part(wide), generator, out=dest)
        return (out if dest is not None else like(out, wide)), None

    def narrow_bytes(self, elements: int) -> int:
        return 4 * elements  # the random integers (stochastic_round.py; the estimator's count)


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


FP16 = Fp16()
BF16 = Bf16()
