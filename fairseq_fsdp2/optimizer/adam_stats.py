"""Adam's two moments kept in 16 bits between steps: ``--fp16-adam-stats`` (fairseq's flag) and
``--bf16-adam-stats`` (the plugin's); or in 8 bits, block-wise quantized:
``--eight-bit-adam-stats`` (the plugin's; the format: blockwise_8bit.py).

Why: fairseq's Adam keeps two float32 tensors per parameter (``exp_avg``, ``exp_avg_sq``): with
FSDP2's fp32 master shards and gradients, half of what each rank holds for the model. In 16 bits
they take half as much (4 bytes per parameter element instead of 8, per shard).

fp16, as fairseq's FusedAdamV1 keeps them (fairseq/optim/fused_adam.py; stock fairseq has the
flag with that CUDA optimizer only): after each step a moment is stored divided by its scale,
``1e-8 + max|moment| / 65504``, so that its largest element sits at fp16's largest finite value
and small ones stay clear of fp16's underflow; the scale (a float32 scalar) is stored beside it
under fairseq's keys (``exp_avg_scale``, ``exp_avg_sq_scale``), and the next step multiplies it
back. The maximum is the whole tensor's, as in fairseq: each rank's shard maximum, then an
all-reduce (max, one per bucket below); so the state means the same thing at any world size and
DCP reshards it as it is (the fp16 tensor cut like the parameter; the scales the same
everywhere).

bf16: bf16 has float32's exponent range, so no scale; its 8-bit significand is rounded
stochastically (stochastic_round.py says why: rounded to nearest, the second moment could never
decrease). The random numbers are drawn from a generator per parameter and moment, seeded by
the run's ``--seed``, the step, the parameter's place, the moment and the shard's place, so a
resumed run draws what the uninterrupted run drew.

8 bits: each parameter of at least blockwise_8bit.MIN_NUMEL elements and two dimensions
keeps its moments as uint8 codes shaped like it (1 byte per element) and float32 block maxima
(``exp_avg_absmax``, ``exp_avg_sq_absmax``: one per BLOCK elements of a row), both sharded like
the parameter's rows, so DCP reshards them; smaller ones keep float32 moments. The codes are
rounded stochastically, from the generator bf16 uses.

How: bf16 and 8-bit moments (and float32 ones with 16-bit gradient shards, or a state saved in
another format) are stepped a chunk of rows at a time (row_chunk_step.py): a chunk's moments
widened to float32, fairseq's Adam steps them (on the local shards: local_shard_step.py), and
they are narrowed again into the rows they came from. fp16 moments need the whole tensor's
maximum after the step for their scale, so their step runs a bucket of parameters at a time
(FusedAdamV1 runs one), their moments widened whole; a bucket holds no more elements than the
largest parameter (BUCKET_MIN at least), whose 16-bit moments are released while it steps; so
does the DTensor-dispatch reference (``local_shards=False``), drawing from the same streams as
the chunked step. Loading a checkpoint
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

from .. import settings
from ..sharding.mesh import comm_device, local_part
from .blockwise_8bit import abs_max, dequantize, quantize, rows_like
from .local_shard_step import ELEMENTWISE, mix_into
from .row_chunk_step import (ABSMAX_KEYS, MOMENTS, SCALE_KEYS, SIGNED, SIXTEEN_BIT,
                             RowChunkSteps, like, shard_coordinate, shard_dims, stream_seed)
from .stochastic_round import generator_for, to_bf16_stochastic

#: fairseq's FusedAdamV1: scale = SCALE_FLOOR + max|moment| / FP16_MAX
FP16_MAX = 65504.0
SCALE_FLOOR = 1e-8
#: moments stored in fewer bits than float32's, which torch's load_state_dict would cast
NARROW = (*SIXTEEN_BIT, torch.uint8)
__all__ = ["ABSMAX_KEYS", "MOMENTS", "SCALE_KEYS", "SIGNED", "stream_seed"]


class Held:
    """A 16-bit (or 8-bit) state tensor passed through torch's ``load_state_dict`` untouched
    (it casts every state tensor of a floating parameter to the parameter's dtype; other
    objects it keeps)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _hold_16_bit(optimizer: torch.optim.Optimizer, state_dict: dict) -> Optional[dict]:
    """load_state_dict pre-hook: wrap the 16-bit (8-bit) moments laid out like their parameter
    (a stock checkpoint's full tensors for sharded parameters are not: full_state.py cuts
    those, in float32)."""
    if "state" not in state_dict or "param_groups" not in state_dict:
        return None
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in optimizer.param_groups)))

    def hold(param, key, value):
        if key in MOMENTS and torch.is_tensor(value) and value.dtype in NARROW and \
                isinstance(value, DTensor) == isinstance(param, DTensor) and \
                value.shape == param.shape:
            return Held(value)
        return value
    state_dict["state"] = {
        index: {k: hold(params[index], k, v) for k, v in per_param.items()}
        if index in params and isinstance(per_param, dict) else per_param
        for index, per_param in state_dict["state"].items()}
    return state_dict


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


#: fp16 moments (and the DTensor-dispatch reference): a step widens the moments of a bucket of
#: consecutive parameters at a time, of at most max(the largest parameter shard, BUCKET_MIN)
#: elements (fp16's scale is the whole tensor's maximum after the step: a parameter's moments
#: are widened whole), one fp16 all-reduce per bucket, not per parameter, and few calls into
#: the optimizer (each costs CPU time a GPU waits for). bf16, 8-bit and float32 moments step
#: a chunk of rows at a time instead (row_chunk_step.py).
BUCKET_MIN = 1 << 22
#: Parameter shards of at most KEEP_MAX elements keep their 16-bit tensors through the step and
#: are written back in place: no new DTensor per step (DTensor.from_local costs more CPU than
#: their arithmetic). Larger ones release theirs while they step (4 bytes per element).
KEEP_MAX = 1 << 20


class SixteenBitMoments(RowChunkSteps):
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
    _numels = None  # parameter -> elements of its local shard

    def takes_16_bit_grads(self) -> bool:
        """Whether the step can take 16-bit gradient shards and the factors multiply_grads
        left pending for them (settings.step_takes_16_bit_grads decides)."""
        return settings.step_takes_16_bit_grads(
            "adam", FORMAT_OF[self.moment_dtype],
            any(group.get("amsgrad", False) for group in self.param_groups), self.local_shards)

    def steps_in_row_chunks(self, narrow_grads: bool) -> bool:
        """Whether this step runs a chunk of rows at a time (row_chunk_step.py), with
        ``narrow_grads`` (16-bit gradient shards) given: settings.row_chunked_step decides."""
        return settings.row_chunked_step(self.takes_16_bit_grads(),
                                         FORMAT_OF[self.moment_dtype], narrow_grads,
                                         self.mixed_state_loaded)

    def step(self, closure=None):
        narrow_grads = any(p.grad is not None and p.grad.dtype in SIXTEEN_BIT
                           for group in self.param_groups for p in group["params"])
        if self.moment_dtype == torch.float32 and not self.mixed_state_loaded and \
                not narrow_grads:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.steps_in_row_chunks(narrow_grads):
            self.step_in_row_chunks()
            self.mixed_state_loaded = False
            return loss
        groups = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = []
            index = 0
            for group, params in zip(self.param_groups, groups):
                stepped = []
                for p in params:
                    index += 1  # the parameter's place: bf16's random stream
                    if p.grad is not None:
                        stepped.append((index, p))
                for bucket in self._buckets(stepped):
                    kept: dict = {}
                    for _, p in bucket:
                        self._widen(p, kept)
                    group["params"] = [p for _, p in bucket]
                    super().step()
                    group["params"] = []
                    self._narrow(bucket, kept)
        finally:
            for group, params in zip(self.param_groups, groups):
                group["params"] = params
        self.mixed_state_loaded = False
        return loss

    def _numel(self, p: torch.Tensor) -> int:
        if self._numels is None:
            self._numels = {}
        if id(p) not in self._numels:  # parameters live as long as the optimizer
            self._numels[id(p)] = local_part(p).numel()
        return self._numels[id(p)]

    def _buckets(self, stepped: list):
        """Consecutive (index, parameter) pairs, at most ``limit`` elements a bucket, each
        bucket's parameters laid out alike (one all-reduce serves them all)."""
        sizes = [self._numel(p) for _, p in stepped]
        limit = max([BUCKET_MIN, *sizes])
        bucket: list = []
        total, layout = 0, None
        for (index, p), n in zip(stepped, sizes):
            this = (id(p.device_mesh), p.placements) if isinstance(p, DTensor) else None
            if bucket and (total + n > limit or this != layout):
                yield bucket
                bucket, total = [], 0
            bucket.append((index, p))
            total, layout = total + n, this
        if bucket:
            yield bucket

    def _widen(self, p: torch.Tensor, kept: dict) -> None:
        state = self.state.get(p)
        if not state:
            return  # the first step creates float32 moments
        for key in MOMENTS:
            value, scale = state.get(key), state.pop(SCALE_KEYS[key], None)
            absmax = state.pop(ABSMAX_KEYS[key], None)
            if value is None or (value.dtype == torch.float32 and scale is None):
                continue
            if value.dtype == torch.uint8:  # 8 bits: on the local shards whatever local_shards
                local = local_part(value)
                if self.moment_dtype == torch.uint8 and self._numel(p) <= KEEP_MAX:
                    kept[id(p), key] = (value, local, absmax, local_part(absmax))
                wide = dequantize(local, local_part(absmax), SIGNED[key])
                state[key] = wide if self.local_shards else like(wide, p)  # DTensor dispatch
                continue
            if not self.local_shards:  # fairseq: exp_avg.float() * state["exp_avg_scale"]
                wide = value.float()
                state[key] = wide * scale if scale is not None else wide
                continue
            local = local_part(value)
            wide = local.float()
            if scale is not None:
                wide.mul_(scale)
            if local.dtype == self.moment_dtype and self._numel(p) <= KEEP_MAX:
                kept[id(p), key] = (value, local)  # the DTensor, and its local tensor
            # a plain tensor: the local-shard step takes it as it is (local_shard_step.py)
            state[key] = wide

    def _narrow(self, bucket: list, kept: dict) -> None:
        """Store the bucket's float32 moments in 16 bits: into the (local) tensors kept through
        the step, or new ones laid out like their parameter."""
        if self.moment_dtype == torch.float16:
            scales = iter(self._scales(bucket))
            for _, p in bucket:
                state = self.state[p]
                for key in MOMENTS:
                    value, scale = state[key], next(scales)
                    old = kept.get((id(p), key))
                    if not self.local_shards:  # fairseq: (exp_avg / scale).half()
                        state[key] = (value / scale).half()
                    elif old is not None:  # copy_ rounds to nearest, as half() does
                        old[1].copy_(local_part(value).div_(scale))
                        state[key] = old[0]
                    else:
                        state[key] = like(local_part(value).div_(scale).half(), p)
                    state[SCALE_KEYS[key]] = scale
        elif self.moment_dtype == torch.bfloat16:
            for index, p in bucket:
                state = self.state[p]
                for k, key in enumerate(MOMENTS):
                    local, old = local_part(state[key]), kept.get((id(p), key))
                    generator = self._generator(index, k, p, local.device)
                    if old is not None:
                        to_bf16_stochastic(local, generator, out=old[1])
                        state[key] = old[0]
                    else:
                        state[key] = like(to_bf16_stochastic(local, generator), p)
        elif self.moment_dtype == torch.uint8:
            self._quantize(bucket, kept)
        else:  # float32 (a 16-bit state was loaded): the widened moments, as DTensors again
            for _, p in bucket:
                state = self.state[p]
                for key in MOMENTS:
                    if not isinstance(state[key], DTensor):
                        state[key] = like(state[key], p)

    def _quantize(self, bucket: list, kept: dict) -> None:
        """Store the bucket's float32 moments in 8 bits (blockwise_8bit.py), into the codes and
        block maxima kept through the step or new ones; parameters too small for 8 bits (or
        sharded on another dimension than rows) keep float32 moments."""
        for index, p in bucket:
            state = self.state[p]
            eight_bit = self.moment_format(p) == torch.uint8
            for k, key in enumerate(MOMENTS):
                local = local_part(state[key])
                if not eight_bit:
                    if not isinstance(state[key], DTensor):
                        state[key] = like(local, p)
                    continue
                generator = self._generator(index, k, p, local.device)
                old = kept.get((id(p), key))
                if old is not None:
                    quantize(local, SIGNED[key], generator, codes=old[1], absmax=old[3])
                    state[key], state[ABSMAX_KEYS[key]] = old[0], old[2]
                else:
                    codes, absmax = quantize(local, SIGNED[key], generator)
                    state[key], state[ABSMAX_KEYS[key]] = like(codes, p), rows_like(absmax, p)

    def _generator(self, index: int, k: int, p: torch.Tensor, device) -> torch.Generator:
        """The random stream of moment ``k`` of the parameter in place ``index``: the one the
        row-chunked step draws from (row_chunk_step.py)."""
        return generator_for(device, stream_seed(self.stats_seed, self.state[p]["step"], index,
                                                 k, *shard_coordinate(p)))

    def _scales(self, bucket: list) -> list[torch.Tensor]:
        """fairseq's scale of each moment of the bucket: 1e-8 + max|moment| / 65504, the max
        over the whole tensor (float32 scalars, the same on every rank)."""
        moments = [self.state[p][key] for _, p in bucket for key in MOMENTS]
        if not self.local_shards:  # fairseq: torch.norm(t, inf), through DTensor dispatch
            peaks = torch.stack([_full(torch.norm(m, float("inf"))) for m in moments])
        else:
            locals_ = [local_part(m) for m in moments]
            peaks = torch.stack([abs_max(m) if m.numel() else
                                 m.new_zeros(()) for m in locals_])
            p = bucket[0][1]
            if isinstance(p, DTensor):
                for dim in shard_dims(p):  # the maximum over the shards (HSDP replicas agree)
                    group = p.device_mesh.get_group(dim)
                    peaks = peaks.to(comm_device(group))
                    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
                peaks = peaks.to(locals_[0].device)
        scales = SCALE_FLOOR + peaks / FP16_MAX
        return [s.clone() for s in scales.unbind()]  # each saved on its own

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
                                               SCALE_KEYS[key] in per_param or
                                               ABSMAX_KEYS[key] in per_param):
                    mixed = True  # a float32 run widens it at its next step
        self.mixed_state_loaded = mixed


#: --fp16-adam-stats / --bf16-adam-stats / --eight-bit-adam-stats -> the moments' dtype
#: between steps (uint8: block-wise quantized codes)
MOMENT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                 "8bit": torch.uint8}
#: the format's name (settings.MOMENT_FORMATS) of each moment dtype
FORMAT_OF = {dtype: name for name, dtype in MOMENT_DTYPES.items()}


def use_16_bit_moments(torch_optimizer: torch.optim.Optimizer, stats: str = "fp32",
                       local_shards: bool = True, seed: int = 0) -> bool:
    """Keep the moments of ``torch_optimizer`` (if it is fairseq's Adam) as ``stats`` asks
    (``fp32``, ``fp16``, ``bf16``, ``8bit``); returns whether it is Adam. Every Adam gets the
    mixin, so that a 16-bit or 8-bit state loaded into a float32 run is widened."""
    if not mix_into(torch_optimizer, SixteenBitMoments, ELEMENTWISE):
        return False
    torch_optimizer.moment_dtype = MOMENT_DTYPES[stats]
    torch_optimizer.local_shards = local_shards
    torch_optimizer.stats_seed = seed
    torch_optimizer.grad_factors = []
    return True
