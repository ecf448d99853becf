"""Adam's step a chunk of rows at a time, with its moments stored in float32, bf16 or 8 bits
between steps (adam_stats.py), and 16-bit gradient shards widened a chunk at a time.

Why: with moments stored narrow, the step must widen them to float32 for fairseq's Adam. Widened
a whole parameter at a time, the largest shard's moments set the step's peak: NLLB-3.3B's shared
embedding is 262M elements per rank on 2 GPUs, 2 GiB of float32 moments, its denominator 1 GiB
more. Stepped STEP_CHUNK elements (a whole number of rows) at a time, each chunk's moments are
widened, stepped by fairseq's Adam and narrowed again into the rows they came from: the step's
temporaries are those of one chunk (16 bytes an element and the quantization's), whatever the
model's size.

Why it is exact: Adam is element-wise (local_shard_step.py), so a chunk of rows steps as it would
inside the whole tensor: the same aten operations on the same values, bit for bit (on a CPU
these operations compute the same value in their vector loops and their scalar tails, so where
a chunk or a thread's share of it begins changes nothing; tests/test_row_chunk_step.py compares
with one chunk a parameter, and a 4.2M-element parameter stepped by 2 threads with an
independent reference). The stochastic rounding draws from one generator per parameter and
moment (seeded by the run's ``--seed``, the step, the parameter's place, the moment and the
shard's place), rows in order; on a CPU torch draws a fixed number of random bits per element,
so the draws of consecutive chunks are those of the whole tensor: 8 bits draw whole rows of
blocks, and bf16 takes four elements' draws from each 64-bit draw, so its chunks hold a
multiple of ALIGN elements (the last of a parameter excepted): a chunk ending inside a 64-bit
draw would leave the rest of it unused and shift every later draw. (On CUDA the generator
advances by kernel launch: chunked draws differ from one call's, and are as reproducible: a
resumed run chunks as the uninterrupted one.)

Gradients: when FSDP2 keeps the reduce-scatter's 16-bit output as the gradient shard
(sharding/narrow_grads.py), ``multiply_grads`` cannot scale it in place without rounding to 16
bits; the factors are kept (``grad_factors``) and applied in order to each widened chunk, as
fairseq's in-place scaling of an fp32 gradient (the 16-bit value widened, exactly) would have
applied them: the same float32 products.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from .. import chunks
from ..sharding.mesh import local_part
from .blockwise_8bit import dequantize, quantizable, quantize, rows_like
from .stochastic_round import generator_for, to_bf16_stochastic

MOMENTS = ("exp_avg", "exp_avg_sq")
SCALE_KEYS = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
#: 8 bits: the float32 block maxima of each moment's codes
ABSMAX_KEYS = {"exp_avg": "exp_avg_absmax", "exp_avg_sq": "exp_avg_sq_absmax"}
#: 8 bits: the first moment's map is signed, the second's unsigned
SIGNED = {"exp_avg": True, "exp_avg_sq": False}
#: elements stepped at once (a chunk of a large parameter's rows, or several small parameters)
STEP_CHUNK = chunks.STEP_ELEMENTS
#: a chunk's elements are a multiple of this: of 4 (bf16's rounding takes four elements' draws
#: from each 64-bit draw), and of the widest CPU vector loop's unit (2 x 16 float32 lanes, twice)
ALIGN = 64
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def stream_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (the same on every platform and Python)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (1 << 63)
    return value


def like(local: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``local`` as the DTensor ``template`` is (its mesh, placements, global shape)."""
    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def rows_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a plain tensor or sharded on dim 0 only (FSDP2's default): then its
    8-bit blocks, within rows, lie on one rank each."""
    return not isinstance(p, DTensor) or all(
        not pl.is_shard() or pl.dim == 0 for pl in p.placements)


def shard_dims(p: torch.Tensor) -> list[int]:
    return [d for d, pl in enumerate(p.placements) if pl.is_shard()] \
        if isinstance(p, DTensor) else []


def shard_coordinate(p: torch.Tensor) -> list[int]:
    """Where ``p``'s shard sits on the mesh's sharded dimensions (not on HSDP's replicated
    one: replicas draw alike and stay equal)."""
    coordinate = p.device_mesh.get_coordinate() if isinstance(p, DTensor) else None
    return [coordinate[d] for d in shard_dims(p)] if coordinate else []


def rows_per_chunk(row: int, limit: int) -> int:
    """Rows of ``row`` elements stepped at once: at most ``limit`` elements (at least the
    alignment unit's rows), a multiple of ALIGN elements."""
    unit = ALIGN // math.gcd(max(row, 1), ALIGN)
    return chunks.rows_per_chunk(row, limit, unit)


def widened(grad: torch.Tensor, factors: list,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A gradient (chunk) in float32 with the pending factors applied in order: a 16-bit one
    widened (exact) into ``out`` (flat, at least grad's elements) or a new tensor; a float32
    one as it is (its factors were applied)."""
    if grad.dtype not in SIXTEEN_BIT:
        return grad
    wide = grad.float() if out is None else out[:grad.numel()].view(grad.shape).copy_(grad)
    for c in factors:
        wide.mul_(c.to(wide.device) if torch.is_tensor(c) else c)
    return wide


class _Moment:
    """One moment of one parameter through a chunked step: where its rows are read from (the
    stored format) and written to (the run's format, in place when they agree)."""

    def __init__(self, state: dict, key: str, fmt: torch.dtype, p: torch.Tensor,
                 generator_seed: int):
        self.key, self.fmt, self.p, self.seed = key, fmt, p, generator_seed
        self.old = state.get(key)
        self.scale = state.get(SCALE_KEYS[key])
        self.old_absmax = state.get(ABSMAX_KEYS[key])
        self.generator: Optional[torch.Generator] = None
        self.src = None if self.old is None else local_part(self.old)
        self.src_absmax = None if self.old_absmax is None else local_part(self.old_absmax)
        local = local_part(p)
        in_place = self.old is not None and self.src.dtype == fmt and self.scale is None and \
            (fmt != torch.uint8 or self.old_absmax is not None)
        if in_place:
            self.dest, self.dest_absmax = self.src, self.src_absmax
        else:
            self.dest = torch.empty(local.shape, dtype=fmt, device=local.device)
            self.dest_absmax = None
            if fmt == torch.uint8:
                row = math.prod(local.shape[1:])
                self.dest_absmax = torch.empty((local.shape[0], -(-row // 256)),
                                               dtype=torch.float32, device=local.device)
        self.in_place = in_place

    def read(self, a: int, b: int, scratch: "_Scratch", offset: int) -> Optional[torch.Tensor]:
        """Rows a:b in float32: a view where stored in float32 (the step updates it there),
        else widened into the step's scratch space at ``offset``."""
        if self.src is None:
            return None
        src = rows_of(self.src, a, b)
        if self.src.dtype == torch.float32 and self.scale is None:
            return src
        wide = scratch.get(self.key, offset, src.numel()).view(src.shape)
        if self.src.dtype == torch.uint8:
            return dequantize(src, self.src_absmax[a:b], SIGNED[self.key], out=wide)
        wide.copy_(src)
        return wide.mul_(self.scale) if self.scale is not None else wide

    def write(self, a: int, b: int, value: torch.Tensor) -> None:
        dest = rows_of(self.dest, a, b)
        if self.fmt == torch.float32:
            if not self.in_place or value.data_ptr() != dest.data_ptr():
                dest.copy_(value)
            return
        if self.generator is None:
            self.generator = generator_for(value.device, self.seed)
        if self.fmt == torch.bfloat16:
            to_bf16_stochastic(value, self.generator, out=dest)
        else:
            quantize(value, SIGNED[self.key], self.generator, codes=dest,
                     absmax=self.dest_absmax[a:b])

    def store(self, state: dict) -> None:
        """The moment as the parameter's state: the old DTensor where its rows were updated in
        place, else the new tensor laid out like the parameter."""
        state.pop(SCALE_KEYS[self.key], None)
        state.pop(ABSMAX_KEYS[self.key], None)
        if self.in_place:
            state[self.key] = self.old
            if self.old_absmax is not None:
                state[ABSMAX_KEYS[self.key]] = self.old_absmax
            return
        state[self.key] = like(self.dest, self.p)
        if self.dest_absmax is not None:
            state[ABSMAX_KEYS[self.key]] = rows_like(self.dest_absmax, self.p)


class RowChunkSteps:
    """Mixin for fairseq's Adam under SixteenBitMoments (adam_stats.py): ``step_in_row_chunks``
    steps every parameter with a gradient a chunk of rows at a time, its moments kept in the
    run's format (``moment_dtype``; parameters too small for 8 bits keep float32)."""

    #: elements stepped at once (tests set it small to compare with one chunk a parameter)
    step_chunk: int = STEP_CHUNK
    #: factors multiply_grads left pending for the 16-bit gradients (grad_norm.py)
    grad_factors: list = []

    def moment_format(self, p: torch.Tensor) -> torch.dtype:
        if self.moment_dtype == torch.uint8:
            return torch.uint8 if quantizable(p.shape) and rows_sharded(p) else torch.float32
        return self.moment_dtype

    def step_in_row_chunks(self) -> None:
        index = 0
        for group in self.param_groups:
            params = group["params"]
            calls: list[list] = [[]]
            size = 0
            moments = []
            for p in params:
                index += 1  # the parameter's place: its random streams
                if p.grad is None:
                    continue
                state = self.state.get(p) or {}
                step = state.get("step", 0) + 1
                fmt = self.moment_format(p)
                entry = [_Moment(state, key, fmt, p, stream_seed(
                    self.stats_seed, step, index, k, *shard_coordinate(p)))
                    for k, key in enumerate(MOMENTS)]
                moments.append((p, entry, step - 1 if state else None))
                local = local_part(p)
                rows, row = (local.shape[0], math.prod(local.shape[1:])) if local.dim() else (1, 1)
                chunk = rows_per_chunk(row, self.step_chunk)
                for a in range(0, max(rows, 1), chunk):
                    b = min(rows, a + chunk)
                    n = (b - a) * row
                    if calls[-1] and size + n > self.step_chunk:
                        calls.append([])
                        size = 0
                    calls[-1].append((len(moments) - 1, a, b, n))
                    size += n
            scratch = _Scratch(max(sum(n for *_, n in call) for call in calls),
                               local_part(params[0]).device if params else None)
            for call in calls:
                if call:
                    self._step_pieces(group, params, moments, call, scratch)
            for p, entry, _ in moments:
                state = self.state[p]
                for m in entry:
                    m.store(state)
        self.grad_factors = []

    def _step_pieces(self, group: dict, params: list, moments: list, call: list,
                     scratch: "_Scratch") -> None:
        """One call of fairseq's Adam (through the local-shard step) on the rows ``call`` names:
        each a plain view of the parameter's local rows, its gradient widened, its moments
        read in float32 (into ``scratch``, each piece at its own offset); then the moments
        written back in the run's format."""
        pieces, states = [], {}
        offset = 0
        with torch.no_grad():
            for i, a, b, n in call:
                p, entry, before = moments[i]
                piece = rows_of(local_part(p), a, b)
                grad = rows_of(local_part(p.grad), a, b)
                piece.grad = widened(grad, self.grad_factors, out=scratch.get(
                    "grad", offset, n) if grad.dtype in SIXTEEN_BIT else None)
                if before is not None:  # else the first step: Adam makes zero moments
                    states[piece] = {"step": before, **{
                        m.key: m.read(a, b, scratch, offset) for m in entry}}
                pieces.append(piece)
                offset += n
        held = self.state
        self.state = states
        group["params"] = pieces
        try:
            super().step()
        finally:
            self.state = held
            group["params"] = params
        for piece, (i, a, b, _) in zip(pieces, call):
            p, entry, _ = moments[i]
            new = states[piece]
            self.state[p]["step"] = new["step"]
            for m in entry:
                m.write(a, b, new[m.key])
            piece.grad = None


class _Scratch:
    """The float32 space one step's calls widen into, allocated once a step (on first use) and
    reused by every call (each call's rows widened into it, stepped, narrowed back before the
    next): the 16-bit gradients and the two stored moments, ``elements`` each (the largest
    call's). Why not a new tensor per chunk: on CPU, under MALLOC_MMAP_THRESHOLD_, each new
    buffer costs a page fault per 4 KiB (2.7 us on this project's machines), about as long
    as widening and stepping the 4 KiB, and at NLLB-600M the step widens 2.4 GB a rank. Dropped
    when the step returns: nothing is kept between steps (the estimator counts it as the
    step's temporaries)."""

    def __init__(self, elements: int, device: torch.device):
        self.elements, self.device = elements, device
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, start: int, n: int) -> torch.Tensor:
        """Elements start:start+n of the buffer ``name`` ("grad" or a moment's key)."""
        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.elements, dtype=torch.float32,
                                             device=self.device)
        return self.buffers[name][start:start + n]


def rows_of(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t[a:b] if t.dim() else t
