"""Adam's two moments kept in 16 bits between steps: ``--fp16-adam-stats`` (fairseq's flag) and
``--bf16-adam-stats`` (the plugin's).

Why: fairseq's Adam keeps two float32 tensors per parameter (``exp_avg``, ``exp_avg_sq``): with
FSDP2's fp32 master shards and gradients, half of what each rank holds for the model. In 16 bits
they take half as much (4 bytes per parameter element instead of 8, per shard).

fp16, as fairseq's FusedAdamV1 keeps them (fairseq/optim/fused_adam.py; stock fairseq has the
flag with that CUDA optimizer only): after each step a moment is stored divided by its scale,
``1e-8 + max|moment| / 65504``, so that its largest element sits at fp16's largest finite value
and small ones stay clear of fp16's underflow; the scale (a float32 scalar) is stored beside it
under fairseq's keys (``exp_avg_scale``, ``exp_avg_sq_scale``), and the next step multiplies it
back. The maximum is the whole tensor's, as in fairseq: each rank's shard maximum, then one
all-reduce (max) per parameter; so the state means the same thing at any world size and DCP
reshards it as it is (the fp16 tensor cut like the parameter; the scales the same everywhere).

bf16: bf16 has float32's exponent range, so no scale; its 8-bit significand is rounded
stochastically (stochastic_round.py says why: rounded to nearest, the second moment could never
decrease). The random numbers are drawn from a generator seeded by the run's ``--seed``, the
step, the parameter's place and the shard's, so a resumed run draws what the uninterrupted run
drew.

How: the step runs one parameter at a time, as FusedAdamV1 does: its moments are widened to
float32, fairseq's Adam steps that parameter (on the local shard: local_shard_step.py), and the
moments are narrowed again; one parameter's moments are float32 at a time. Loading a checkpoint
keeps 16-bit moments 16-bit (torch's ``load_state_dict`` would cast every floating state tensor
to the parameter's float32), and a state saved in the other format (a run resumed with or without
the flag) is widened at its next step and then stored as this run asks.
"""
from __future__ import annotations

from itertools import chain
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..sharding.mesh import comm_device
from .local_shard_step import ELEMENTWISE, mix_into
from .stochastic_round import generator_for, to_bf16_stochastic

MOMENTS = ("exp_avg", "exp_avg_sq")
SCALE_KEYS = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
#: fairseq's FusedAdamV1: scale = SCALE_FLOOR + max|moment| / FP16_MAX
FP16_MAX = 65504.0
SCALE_FLOOR = 1e-8
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


class Held:
    """A 16-bit state tensor passed through torch's ``load_state_dict`` untouched (it casts
    every floating tensor of the state to the parameter's dtype; other objects it keeps)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _hold_16_bit(optimizer: torch.optim.Optimizer, state_dict: dict) -> Optional[dict]:
    """load_state_dict pre-hook: wrap the 16-bit moments laid out like their parameter (a
    stock checkpoint's full tensors for sharded parameters are not: full_state.py cuts
    those, in float32)."""
    if "state" not in state_dict or "param_groups" not in state_dict:
        return None
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in optimizer.param_groups)))

    def hold(param, key, value):
        if key in MOMENTS and torch.is_tensor(value) and value.dtype in SIXTEEN_BIT and \
                isinstance(value, DTensor) == isinstance(param, DTensor) and \
                value.shape == param.shape:
            return Held(value)
        return value
    state_dict["state"] = {
        index: {k: hold(params[index], k, v) for k, v in per_param.items()}
        if index in params and isinstance(per_param, dict) else per_param
        for index, per_param in state_dict["state"].items()}
    return state_dict


def stream_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (the same on every platform and Python)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (1 << 63)
    return value


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as the DTensor ``like`` is (its mesh, placements, global shape)."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _shard_dims(p: torch.Tensor) -> list[int]:
    return [d for d, pl in enumerate(p.placements) if pl.is_shard()] \
        if isinstance(p, DTensor) else []


class SixteenBitMoments:
    """Mixin for fairseq's Adam (a torch optimizer): its moments stored as ``moment_dtype``
    between steps (float32: as fairseq keeps them; a 16-bit state loaded from a checkpoint is
    widened at its next step)."""

    moment_dtype: torch.dtype = torch.float32
    #: run the 16-bit conversions on local shards (False: through DTensor dispatch, the
    #: reference the tests compare the local path with)
    local_shards: bool = True
    #: the run's --seed: with the step and the parameter, what bf16's rounding draws from
    stats_seed: int = 0
    #: a state in a format other than moment_dtype's was loaded: widen it at the next step
    mixed_state_loaded: bool = False
    _hold_hook = None  # the pre-hook of the load_state_dict call in progress

    def step(self, closure=None):
        if self.moment_dtype == torch.float32 and not self.mixed_state_loaded:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = []
            index = 0
            for group, params in zip(self.param_groups, groups):
                for p in params:
                    index += 1
                    if p.grad is None:
                        continue
                    self._widen(p)
                    group["params"] = [p]
                    super().step()
                    group["params"] = []
                    self._narrow(p, index)
        finally:
            for group, params in zip(self.param_groups, groups):
                group["params"] = params
        self.mixed_state_loaded = False
        return loss

    def _widen(self, p: torch.Tensor) -> None:
        state = self.state.get(p)
        if not state:
            return  # the first step creates float32 moments
        for key in MOMENTS:
            value, scale = state.get(key), state.pop(SCALE_KEYS[key], None)
            if value is None or (value.dtype == torch.float32 and scale is None):
                continue
            if self.local_shards and isinstance(value, DTensor):
                wide = _local(value).float()
                if scale is not None:
                    wide.mul_(scale)
                state[key] = _like(wide, value)
            else:  # fairseq: exp_avg.float() * state["exp_avg_scale"]
                wide = value.float()
                state[key] = wide * scale if scale is not None else wide

    def _narrow(self, p: torch.Tensor, index: int) -> None:
        state = self.state[p]
        if self.moment_dtype == torch.float16:
            scales = self._scales(p, [state[key] for key in MOMENTS])
            for key, scale in zip(MOMENTS, scales):
                value = state[key]
                if self.local_shards:
                    state[key] = _like(_local(value).div_(scale).half(), value)
                else:  # fairseq: (exp_avg / state["exp_avg_scale"]).half()
                    state[key] = (value / scale).half()
                state[SCALE_KEYS[key]] = scale
        elif self.moment_dtype == torch.bfloat16:
            coordinate = p.device_mesh.get_coordinate() if isinstance(p, DTensor) else []
            shard = [coordinate[d] for d in _shard_dims(p)] if coordinate else []
            for i, key in enumerate(MOMENTS):
                value = state[key]
                seed = stream_seed(self.stats_seed, state["step"], index, i, *shard)
                local = _local(value)
                state[key] = _like(to_bf16_stochastic(local, generator_for(local.device, seed)),
                                   value)

    def _scales(self, p: torch.Tensor, moments: list[torch.Tensor]) -> list[torch.Tensor]:
        """fairseq's scale of each moment: 1e-8 + max|moment| / 65504, max over the whole
        tensor (float32 scalars, the same on every rank)."""
        if not self.local_shards:  # fairseq: torch.norm(t, inf), through DTensor dispatch
            peaks = [torch.norm(m, float("inf")) for m in moments]
            peaks = torch.stack([m.full_tensor() if isinstance(m, DTensor) else m
                                 for m in peaks])
        else:
            locals_ = [_local(m) for m in moments]
            peaks = torch.stack([torch.norm(m, float("inf")) if m.numel() else
                                 m.new_zeros(()) for m in locals_])
            if isinstance(p, DTensor):
                for dim in _shard_dims(p):  # the maximum over the shards (HSDP replicas agree)
                    group = p.device_mesh.get_group(dim)
                    peaks = peaks.to(comm_device(group))
                    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
                peaks = peaks.to(locals_[0].device)
        scales = SCALE_FLOOR + peaks / FP16_MAX
        return [s.clone() for s in scales.unbind()]

    def load_state_dict(self, state_dict):
        # registered now, so that it runs after every other pre-hook (the trainer's reads the
        # sharded checkpoint and hands on what it loaded; full_state.py cuts stock tensors);
        # once: the trainer's hook loads again inside this call, while torch iterates the hooks
        handle = None
        if self._hold_hook is None:
            self._hold_hook = handle = self.register_load_state_dict_pre_hook(_hold_16_bit)
        try:
            super().load_state_dict(state_dict)
        finally:
            if handle is not None:
                handle.remove()
                self._hold_hook = None
        mixed = False
        for per_param in self.state.values():
            for key in MOMENTS:
                value = per_param.get(key)
                if isinstance(value, Held):
                    per_param[key] = value = value.tensor
                if torch.is_tensor(value) and (value.dtype != torch.float32 or
                                               SCALE_KEYS[key] in per_param):
                    mixed = True  # a float32 run widens it at its next step
        self.mixed_state_loaded = mixed


def fit_to_saved(optimizer_state: dict, saved: dict, prefix: str = "optim.state.") -> None:
    """Make ``optimizer_state`` (``get_optimizer_state_dict``'s, parameters by name), the
    destination of a DCP load, hold what the checkpoint holds: each moment in its saved dtype
    and a scale where the checkpoint has one; so that a run resumed with or without a 16-bit
    flag reads the other format's state as it was (its next step converts it). ``saved``: the
    checkpoint's flattened keys (``PREFIX<name>.<key>``) -> the saved tensor's dtype."""
    for name, per_param in optimizer_state.get("state", {}).items():
        for key in MOMENTS:
            value, stored = per_param.get(key), f"{prefix}{name}.{key}"
            if not torch.is_tensor(value) or stored not in saved:
                continue
            dtype = saved[stored]
            if dtype is not None and dtype != value.dtype:
                per_param[key] = value.to(dtype)
            scale_key = SCALE_KEYS[key]
            if f"{prefix}{name}.{scale_key}" not in saved:
                per_param.pop(scale_key, None)
            elif not torch.is_tensor(per_param.get(scale_key)):
                per_param[scale_key] = torch.ones((), device=_local(value).device)


#: --fp16-adam-stats / --bf16-adam-stats -> the moments' dtype between steps
MOMENT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def use_16_bit_moments(torch_optimizer: torch.optim.Optimizer, stats: str = "fp32",
                       local_shards: bool = True, seed: int = 0) -> bool:
    """Keep the moments of ``torch_optimizer`` (if it is fairseq's Adam) as ``stats`` asks
    (``fp32``, ``fp16``, ``bf16``); returns whether it is Adam. Every Adam gets the mixin, so
    that a 16-bit state loaded into a float32 run is widened."""
    if not mix_into(torch_optimizer, SixteenBitMoments, ELEMENTWISE):
        return False
    torch_optimizer.moment_dtype = MOMENT_DTYPES[stats]
    torch_optimizer.local_shards = local_shards
    torch_optimizer.stats_seed = seed
    return True
