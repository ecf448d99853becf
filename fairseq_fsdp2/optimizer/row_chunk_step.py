"""Adam's step a chunk of rows at a time, with its moments stored in float32, bf16 or 8 bits
between steps (their formats: moments/), and 16-bit gradient shards widened a chunk at a time.

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
(sharding/sixteen_bit_grads.py), ``multiply_grads`` cannot scale it in place without rounding to 16
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
from . import moments
from .local_shard_step import SIXTEEN_BIT_GRADS, SIXTEEN_BIT_WEIGHTS
from .moments.format import MOMENTS, MomentFormat, shard_dims
from .moments.stochastic_round import generator_for, to_bf16_stochastic

#: elements stepped at once (a chunk of a large parameter's rows, or several small parameters)
STEP_CHUNK = chunks.STEP_ELEMENTS
#: a chunk's elements are a multiple of this: of 4 (bf16's rounding takes four elements' draws
#: from each 64-bit draw), and of the widest CPU vector loop's unit (2 x 16 float32 lanes, twice)
ALIGN = 64


def stream_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (the same on every platform and Python)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (1 << 63)
    return value


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
    if grad.dtype not in SIXTEEN_BIT_GRADS:
        return grad
    wide = grad.float() if out is None else out[:grad.numel()].view(grad.shape).copy_(grad)
    for c in factors:
        wide.mul_(c.to(wide.device) if torch.is_tensor(c) else c)
    return wide


class _Moment:
    """One moment of one parameter through a chunked step: its rows read from the format it is
    stored in, written in the run's format for the parameter (``fmt``: in place when they
    agree)."""

    def __init__(self, state: dict, key: str, fmt: MomentFormat, p: torch.Tensor,
                 generator_seed: int):
        self.key, self.fmt, self.p, self.seed = key, fmt, p, generator_seed
        self.stored = moments.stored_format(state, key)
        self.old = state.get(key)
        side_key = self.stored.side_key(key) if self.stored is not None else None
        self.old_side = state.get(side_key) if side_key else None
        self.generator: Optional[torch.Generator] = None
        self.src = None if self.old is None else local_part(self.old)
        self.src_side = None if self.old_side is None else local_part(self.old_side)
        # in place: stored in the run's format, with its side where it has one
        in_place = self.stored is fmt and (side_key is None or self.old_side is not None)
        if in_place:
            self.dest, self.dest_side = self.src, self.src_side
        else:
            self.dest, self.dest_side = fmt.empty(local_part(p))
        self.in_place = in_place

    def read(self, a: int, b: int, scratch: "_Scratch", offset: int) -> Optional[torch.Tensor]:
        """Rows a:b in float32: a view where stored in float32 (the step updates it there),
        else widened into the step's scratch space at ``offset``."""
        if self.src is None:
            return None
        src = rows_of(self.src, a, b)
        out = scratch.get(self.key, offset, src.numel()).view(src.shape) \
            if self.stored.widened_bytes else None
        return self.stored.widen(src, self.stored.side_rows(self.src_side, a, b), self.key,
                                 out=out)

    def write(self, a: int, b: int, value: torch.Tensor) -> None:
        if self.generator is None and self.fmt.draws:
            self.generator = generator_for(value.device, self.seed)
        self.fmt.narrow(value, self.key, self.generator, dest=rows_of(self.dest, a, b),
                        side=self.fmt.side_rows(self.dest_side, a, b))

    def store(self, state: dict) -> None:
        """The moment as the parameter's state: the old DTensors where its rows were updated in
        place, else the new tensors laid out like the parameter."""
        for side_key in moments.side_keys(self.key):
            state.pop(side_key, None)
        if self.in_place:
            stored, side = self.old, self.old_side
        else:
            stored, side = self.fmt.laid_out(self.dest, self.dest_side, self.p)
        state[self.key] = stored
        if side is not None:
            state[self.fmt.side_key(self.key)] = side


class _Weight:
    """One parameter's rows through a chunked step when it is stored in bf16 (settings.
    keeps_bf16_weights: no float32 master copy): each chunk widened to float32 (exact) for
    fairseq's Adam, the stepped rows written back rounded stochastically (moments/
    stochastic_round.py), from the parameter's own stream (the run's seed, the step, the
    parameter's place, stream MOMENTS' length: after the moments', the shard's place), so that a
    resumed run draws as the uninterrupted one did. Why stochastic: at fine-tuning learning
    rates an update is mostly far below half a bf16 unit of its weight (2^-9 to 2^-8 of it);
    rounded to nearest it is lost, rounded stochastically it is kept on average."""

    def __init__(self, seed: int, nearest: bool):
        self.seed, self.nearest = seed, nearest
        self.generator: Optional[torch.Generator] = None

    def write(self, stored: torch.Tensor, value: torch.Tensor) -> None:
        """The float32 rows ``value`` (used as scratch) into the bf16 rows ``stored``."""
        if self.nearest:  # the test's control (RowChunkSteps.round_weights_to_nearest)
            stored.copy_(value)
            return
        if self.generator is None:
            self.generator = generator_for(value.device, self.seed)
        to_bf16_stochastic(value, self.generator, out=stored)


class RowChunkSteps:
    """Mixin for fairseq's Adam under StoredMoments (adam_stats.py): ``step_in_row_chunks``
    steps every parameter with a gradient a chunk of rows at a time, its moments kept in the
    run's format (``moments``; parameters too small for 8 bits keep float32)."""

    #: elements stepped at once (tests set it small to compare with one chunk a parameter)
    step_chunk: int = STEP_CHUNK
    #: factors multiply_grads left pending for the 16-bit gradients (grad_norm.py)
    grad_factors: list = []
    #: bf16 weights written back rounded to nearest, not stochastically: only the tests'
    #: control run (tests/probes/nearest_weights.py), to show what stochastic rounding keeps
    round_weights_to_nearest: bool = False

    def format_for(self, p: torch.Tensor) -> MomentFormat:
        """The format of ``p``'s moments in this run (8 bits: float32 for a small one)."""
        return self.moments.for_parameter(p)

    def step_in_row_chunks(self, only: Optional[list] = None) -> None:
        """Step every parameter with a gradient, or ``only`` those listed (group number, place,
        parameter; the step in backward: step_in_backward.py), each drawing from the streams of
        its place among all the groups' parameters, as in a step of all of them."""
        index = 0
        for number, group in enumerate(self.param_groups):
            params = group["params"]
            calls: list[list] = [[]]
            size = 0
            moments = []
            if only is None:
                placed = [(index + i, p) for i, p in enumerate(params, 1)]
                index += len(params)
            else:
                placed = [(place, p) for g, place, p in only if g == number]
            for place, p in placed:  # the parameter's place: its random streams
                if p.grad is None:
                    continue
                state = self.state.get(p) or {}
                step = state.get("step", 0) + 1
                fmt = self.format_for(p)
                entry = [_Moment(state, key, fmt, p, stream_seed(
                    self.stats_seed, step, place, k, *shard_coordinate(p)))
                    for k, key in enumerate(MOMENTS)]
                weight = _Weight(stream_seed(self.stats_seed, step, place, len(MOMENTS),
                                             *shard_coordinate(p)),
                                 self.round_weights_to_nearest) \
                    if p.dtype in SIXTEEN_BIT_WEIGHTS else None
                moments.append((p, entry, step - 1 if state else None, weight))
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
            for p, entry, *_ in moments:
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
        pieces, states, kept = [], {}, []
        offset = 0
        with torch.no_grad():
            for i, a, b, n in call:
                p, entry, before, weight = moments[i]
                piece = rows_of(local_part(p), a, b)
                kept.append(piece)
                if weight is not None:  # bf16 weights: stepped in float32 (exact widening)
                    piece = scratch.get("param", offset, n).view(piece.shape).copy_(piece)
                grad = rows_of(local_part(p.grad), a, b)
                piece.grad = widened(grad, self.grad_factors, out=scratch.get(
                    "grad", offset, n) if grad.dtype in SIXTEEN_BIT_GRADS else None)
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
        for piece, stored, (i, a, b, _) in zip(pieces, kept, call):
            p, entry, _, weight = moments[i]
            new = states[piece]
            if weight is not None:
                with torch.no_grad():
                    weight.write(stored, piece)
            self.state[p]["step"] = new["step"]
            for m in entry:
                m.write(a, b, new[m.key])
            piece.grad = None


class _Scratch:
    """The float32 space one step's calls widen into, allocated once a step (on first use) and
    reused by every call (each call's rows widened into it, stepped, narrowed back before the
    next): the 16-bit gradients, the two stored moments and bf16 weights, ``elements`` each (the
    largest call's). Why not a new tensor per chunk: on CPU, under MALLOC_MMAP_THRESHOLD_, each new
    buffer costs a page fault per 4 KiB (2.7 us on this project's machines), about as long
    as widening and stepping the 4 KiB, and at NLLB-600M the step widens 2.4 GB a rank. Dropped
    when the step returns: nothing is kept between steps (the estimator counts it as the
    step's temporaries)."""

    def __init__(self, elements: int, device: torch.device):
        self.elements, self.device = elements, device
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, start: int, n: int) -> torch.Tensor:
        """Elements start:start+n of the buffer ``name`` ("grad", "param" or a moment's key)."""
        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.elements, dtype=torch.float32,
                                             device=self.device)
        return self.buffers[name][start:start + n]


def rows_of(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t[a:b] if t.dim() else t
