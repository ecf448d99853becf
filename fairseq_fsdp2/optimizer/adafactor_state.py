"""fairseq's Adafactor over FSDP2's sharded (DTensor) parameters.

Why: Adafactor keeps, for each parameter of two or more dimensions, the mean of the squared
gradient over its rows and over its columns instead of a full second moment. fairseq creates
these statistics as ``torch.zeros(shape).to(grad)``: plain tensors, which DTensor refuses to
combine with the sharded gradient ("got mixed torch.Tensor and DTensor"), so every run with
``--optimizer adafactor`` stopped at its first step.

What: before fairseq's step sees a parameter for the first time, its state is created here
with the keys and zero values fairseq's own initialisation gives it, the two statistics as
DTensors laid out as the reductions that update them produce (:func:`reduced_placements`): the
mean over the last dimension keeps the parameter's row sharding, the mean over the rows (the
dimension FSDP2 shards) is all-reduced, so replicated. fairseq's step then runs unchanged
through DTensor dispatch (the optimizer is not elementwise: local_shard_step.py leaves it there).
Stock checkpoints hold the statistics as full tensors; :func:`state_placements` says how to cut
them when they are loaded (checkpoint/full_state.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from .local_shard_step import mix_into

#: Optimizers whose state holds factored statistics (module, class name).
FACTORED = frozenset({("fairseq.optim.adafactor", "Adafactor")})
#: state key -> the parameter dimension its statistic is the mean over
REDUCED_DIM = {"exp_avg_sq_row": -1, "exp_avg_sq_col": -2}


def reduced_shape(shape: Sequence[int], dim: int) -> list[int]:
    """The shape of a mean over ``dim`` of a tensor of ``shape``."""
    out = list(shape)
    del out[dim]
    return out


def reduced_placements(placements: Sequence[Placement], ndim: int,
                       dim: int) -> list[Placement]:
    """Placements of a mean over ``dim`` of a DTensor with ``placements`` and ``ndim``
    dimensions, once reduced: sharding along ``dim`` becomes replication (the all-reduce),
    sharding along a later dimension moves down by one."""
    dim %= ndim
    out: list[Placement] = []
    for placement in placements:
        if isinstance(placement, Shard) and placement.dim == dim:
            out.append(Replicate())
        elif isinstance(placement, Shard) and placement.dim > dim:
            out.append(Shard(placement.dim - 1))
        else:
            out.append(placement)
    return out


def state_placements(key: str, value: torch.Tensor,
                     param: DTensor) -> Optional[list[Placement]]:
    """The placements of a full (unsharded) Adafactor statistic ``value`` stored under ``key``
    for ``param``, or None if it is not one."""
    dim = REDUCED_DIM.get(key)
    if dim is None or param.dim() < 2 or list(value.shape) != reduced_shape(param.shape, dim):
        return None
    return reduced_placements(param.placements, param.dim(), dim)


class DTensorFactoredState:
    """Mixin for a torch optimizer listed in :data:`FACTORED` (fairseq's Adafactor): creates
    the state of each sharded parameter with two or more dimensions before its first step."""

    def step(self, *args, **kwargs):
        for group in self.param_groups:
            for p in group["params"]:
                if isinstance(p.grad, DTensor) and not self.state[p]:
                    factored, use_first_moment = self._get_options(group, p.shape)
                    if factored:
                        self.state[p] = initial_state(p, use_first_moment)
        return super().step(*args, **kwargs)


def initial_state(p: DTensor, use_first_moment: bool) -> dict:
    """fairseq's initial Adafactor state for ``p`` (the same keys and zeros), its statistics
    sharded as the module docstring says. fairseq moves each tensor to the gradient's device
    and dtype (``.to(grad)``) at every step."""
    state: dict = {"step": 0, "RMS": 0}
    if use_first_moment:
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
    for key, dim in REDUCED_DIM.items():
        # each rank makes its own part of the zeros: nothing is sent (src_data_rank=None)
        state[key] = distribute_tensor(torch.zeros(reduced_shape(p.shape, dim)), p.device_mesh,
                                       reduced_placements(p.placements, p.dim(), dim),
                                       src_data_rank=None)
    return state


def use_factored_state(torch_optimizer: torch.optim.Optimizer) -> bool:
    """Give ``torch_optimizer`` sharded factored statistics if it keeps them; returns whether
    it does."""
    return mix_into(torch_optimizer, DTensorFactoredState, FACTORED)
