"""Adam's two moments kept in 16 bits between steps: ``--fp16-adam-stats`` (fairseq's flag) and
``--bf16-adam-stats`` (the plugin's); or in 8 bits, block-wise quantized:
``--eight-bit-adam-stats`` (the plugin's; the formats: moments/).

Why: fairseq's Adam keeps two float32 tensors per parameter (``exp_avg``, ``exp_avg_sq``): with
FSDP2's fp32 master shards and gradients, half of what each rank holds for the model. In 16 bits
they take half as much (4 bytes per parameter element instead of 8, per shard).

The formats (what each stores, how it widens and narrows, what it costs): moments/ (fp16 with
fairseq's scales and bf16 rounded stochastically: sixteen_bit.py; 8 bits: eight_bit.py). This
module and row_chunk_step.py compose the step from them; neither looks at a dtype or a side key.

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

import contextlib
from itertools import chain
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from .. import settings
from ..sharding.mesh import local_part
from . import moments
from .local_shard_step import ELEMENTWISE, SIXTEEN_BIT_GRADS, mix_into
from .moments.format import MOMENTS, MomentFormat
from .moments.fp32 import FP32
from .moments.stochastic_round import generator_for
from .row_chunk_step import RowChunkSteps, shard_coordinate, stream_seed


class Held:
    """A 16-bit (or 8-bit) state tensor passed through torch's ``load_state_dict`` untouched
    (it casts every state tensor of a floating parameter to the parameter's dtype; other
    objects it keeps)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _hold_narrow(optimizer: torch.optim.Optimizer, state_dict: dict) -> Optional[dict]:
    """load_state_dict pre-hook: wrap the 16-bit (8-bit) moments laid out like their parameter
    (a stock checkpoint's full tensors for sharded parameters are not: full_state.py cuts
    those, in float32), and, for bf16 parameters (settings.keeps_bf16_weights), float32 moments
    and every float32 side tensor: torch would round them to bf16."""
    if "state" not in state_dict or "param_groups" not in state_dict:
        return None
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in optimizer.param_groups)))

    def hold(param, key, value):
        if not torch.is_tensor(value) or key == "step" or \
                isinstance(value, DTensor) != isinstance(param, DTensor):
            return value
        if key in MOMENTS:
            if value.shape == param.shape and (value.dtype in moments.NARROW_DTYPES or
                                               value.dtype != param.dtype):
                return Held(value)
        elif value.is_floating_point() and value.dtype != param.dtype:
            return Held(value)  # a side (8-bit block maxima, fp16 scales) of bf16 weights
        return value
    state_dict["state"] = {
        index: {k: hold(params[index], k, v) for k, v in per_param.items()}
        if index in params and isinstance(per_param, dict) else per_param
        for index, per_param in state_dict["state"].items()}
    return state_dict


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


def has_narrow_grads(params) -> bool:
    """Whether any of ``params`` holds a 16-bit gradient shard (sixteen_bit_grads.py)."""
    return any(p.grad is not None and p.grad.dtype in SIXTEEN_BIT_GRADS for p in params)


class StoredMoments(RowChunkSteps):
    """Mixin for fairseq's Adam (a torch optimizer): its moments stored in the format
    ``moments`` between steps (float32: as fairseq keeps them; a state of another format
    loaded from a checkpoint is widened at its next step)."""

    #: the run's moment format (moments/)
    moments: MomentFormat = FP32
    #: run the conversions on local shards (False: through DTensor dispatch, the reference the
    #: tests compare the local path with)
    local_shards: bool = True
    #: the run's --seed: with the step and the parameter, what stochastic rounding draws from
    stats_seed: int = 0
    #: a state in a format other than the run's was loaded: widen it at the next step
    mixed_state_loaded: bool = False
    #: the parameters are stored in bf16 (settings.keeps_bf16_weights): every step row-chunked
    bf16_weights: bool = False
    _hold_hook = None  # the pre-hook of the load_state_dict call in progress
    _numels = None  # parameter -> elements of its local shard

    @property
    def moment_dtype(self) -> torch.dtype:
        """What the run's format stores a moment element as."""
        return self.moments.dtype

    def takes_16_bit_grads(self) -> bool:
        """Whether the step can take 16-bit gradient shards and the factors multiply_grads
        left pending for them (settings.step_takes_16_bit_grads decides)."""
        return settings.step_takes_16_bit_grads(
            "adam", self.moments.name,
            any(group.get("amsgrad", False) for group in self.param_groups), self.local_shards)

    def steps_in_row_chunks(self, narrow_grads: bool) -> bool:
        """Whether this step runs a chunk of rows at a time (row_chunk_step.py), with
        ``narrow_grads`` (16-bit gradient shards) given: settings.row_chunked_step decides."""
        return settings.row_chunked_step(self.takes_16_bit_grads(), self.moments.name,
                                         narrow_grads, self.mixed_state_loaded,
                                         self.bf16_weights)

    def fairseqs_own_step(self, narrow_grads: bool) -> bool:
        """Whether fairseq's own step serves as it is: nothing widened or narrowed (float32
        moments, no other format loaded, no 16-bit gradients: ``narrow_grads``, float32
        weights)."""
        return not (self.moments.widened_bytes or self.mixed_state_loaded or narrow_grads
                    or self.bf16_weights)

    @contextlib.contextmanager
    def params_swapped(self):
        """Within (given the groups' own lists): the param groups' parameter lists may be
        replaced (a step of some of them); on exit, each group has its own list back."""
        groups = [group["params"] for group in self.param_groups]
        try:
            yield groups
        finally:
            for group, params in zip(self.param_groups, groups):
                group["params"] = params

    def step(self, closure=None):
        narrow_grads = has_narrow_grads(p for group in self.param_groups
                                        for p in group["params"])
        if self.fairseqs_own_step(narrow_grads):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.steps_in_row_chunks(narrow_grads):
            self.step_in_row_chunks()
            self.mixed_state_loaded = False
            return loss
        with self.params_swapped() as groups:
            for group in self.param_groups:
                group["params"] = []
            index = 0
            for group, params in zip(self.param_groups, groups):
                stepped = []
                for p in params:
                    index += 1  # the parameter's place: its random streams
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
        self.mixed_state_loaded = False
        return loss

    def step_parameters(self, only: list) -> None:
        """Step ``only`` the parameters listed (group number, place among all the groups'
        parameters from 1, parameter; the step in backward: step_in_backward.py) as a step of
        all of them would: the same path (``step``'s: fairseq's own or row-chunked; a
        ``mixed_state_loaded`` is kept for the others, the step after backward clears it), the
        same random streams (by place), each parameter's arithmetic its own (elementwise)."""
        narrow = has_narrow_grads(p for *_, p in only)
        if self.steps_in_row_chunks(narrow):
            self.step_in_row_chunks(only)
            return
        if not self.fairseqs_own_step(narrow):
            raise NotImplementedError("a bucketed step (fp16 moments, amsgrad) steps all "
                                      "parameters at once")  # settings refuses these
        with self.params_swapped():
            for number, group in enumerate(self.param_groups):
                group["params"] = [p for g, _, p in only if g == number]
            super().step()  # fairseq's own, on the local shards (local_shard_step.py)

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
        """``p``'s moments in float32 for fairseq's Adam, from whatever format they are stored
        in (float32 ones stay where they are). Small parameters' moments stored in the run's
        format are ``kept`` (their tensors, and their local tensors), to be narrowed into."""
        state = self.state.get(p)
        if not state:
            return  # the first step creates float32 moments
        for key in MOMENTS:
            stored, value = moments.stored_format(state, key), state.get(key)
            sides = {k: state.pop(k, None) for k in moments.side_keys(key)}
            if stored is None or not stored.widened_bytes:
                continue
            side = sides.get(stored.side_key(key))
            if not self.local_shards:  # DTensor dispatch (8 bits: on the local shard)
                state[key] = stored.widen(value, side, key)
                continue
            local, local_side = local_part(value), None if side is None else local_part(side)
            if stored is self.format_for(p) and self._numel(p) <= KEEP_MAX:
                kept[id(p), key] = (value, local, side, local_side)
            # a plain tensor: the local-shard step takes it as it is (local_shard_step.py)
            state[key] = stored.widen(local, local_side, key)

    def _narrow(self, bucket: list, kept: dict) -> None:
        """Store the bucket's float32 moments in the run's format: into the (local) tensors
        kept through the step, or new ones laid out like their parameter (a parameter too
        small for 8 bits: float32)."""
        sides = iter(self.moments.whole_sides(
            [self.state[p][key] for _, p in bucket for key in MOMENTS], bucket[0][1],
            self.local_shards))
        for index, p in bucket:
            state, fmt = self.state[p], self.format_for(p)
            for k, key in enumerate(MOMENTS):
                value, side, old = state[key], next(sides), kept.get((id(p), key))
                wide = value if not self.local_shards else local_part(value)
                generator = self._generator(index, k, p, local_part(value).device) \
                    if fmt.draws else None
                if old is not None:  # into the tensors kept through the step: a side decided
                    # beforehand (fp16's scale) is the new one, else the format writes its own
                    # where it was (8 bits' block maxima)
                    fmt.narrow(wide, key, generator, dest=old[1],
                               side=old[3] if side is None else side)
                    stored, side = old[0], old[2] if side is None else side
                else:
                    stored, side = fmt.laid_out(*fmt.narrow(wide, key, generator, side=side), p)
                state[key] = stored
                if side is not None:
                    state[fmt.side_key(key)] = side

    def _generator(self, index: int, k: int, p: torch.Tensor, device) -> torch.Generator:
        """The random stream of moment ``k`` of the parameter in place ``index``: the one the
        row-chunked step draws from (row_chunk_step.py)."""
        return generator_for(device, stream_seed(self.stats_seed, self.state[p]["step"], index,
                                                 k, *shard_coordinate(p)))

    def load_state_dict(self, state_dict):
        # registered now, so that it runs after every other pre-hook (the trainer's reads the
        # sharded checkpoint and hands on what it loaded; full_state.py cuts stock tensors);
        # once: the trainer's hook loads again inside this call, while torch iterates the hooks
        handle = None
        if self._hold_hook is None:
            self._hold_hook = handle = self.register_load_state_dict_pre_hook(_hold_narrow)
        try:
            super().load_state_dict(state_dict)
        finally:
            if handle is not None:
                handle.remove()
                self._hold_hook = None
        mixed = False
        for per_param in self.state.values():
            for key, value in list(per_param.items()):
                if isinstance(value, Held):
                    per_param[key] = value.tensor
            for key in MOMENTS:
                value = per_param.get(key)
                if torch.is_tensor(value) and (
                        moments.stored_format(per_param, key) is not FP32 or
                        any(k in per_param for k in moments.side_keys(key))):
                    mixed = True  # a float32 run widens it at its next step
        self.mixed_state_loaded = mixed


#: the format's name (settings.MOMENT_FORMATS) of each stored dtype
FORMAT_OF = {fmt.dtype: name for name, fmt in moments.FORMATS.items()}


def use_16_bit_moments(torch_optimizer: torch.optim.Optimizer, stats: str = "fp32",
                       local_shards: bool = True, seed: int = 0,
                       bf16_weights: bool = False) -> bool:
    """Keep the moments of ``torch_optimizer`` (if it is fairseq's Adam) as ``stats`` asks
    (``fp32``, ``fp16``, ``bf16``, ``8bit``: moments.FORMATS); returns whether it is Adam.
    Every Adam gets the mixin, so that a 16-bit or 8-bit state loaded into a float32 run is
    widened. ``bf16_weights``: the parameters are stored in bf16 (settings.keeps_bf16_weights),
    each update written back with stochastic rounding (row_chunk_step.py)."""
    if not mix_into(torch_optimizer, StoredMoments, ELEMENTWISE):
        return False
    torch_optimizer.moments = moments.named(stats)
    torch_optimizer.local_shards = local_shards
    torch_optimizer.stats_seed = seed
    torch_optimizer.bf16_weights = bf16_weights
    torch_optimizer.grad_factors = []
    return True
