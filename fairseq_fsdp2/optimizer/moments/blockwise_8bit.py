"""Block-wise 8-bit quantization of Adam's moments (``--eight-bit-adam-stats``, eight_bit.py).

The format is bitsandbytes' and torchao's 8-bit optimizer state (Dettmers et al., "8-bit
Optimizers via Block-wise Quantization", 2021): each block of BLOCK elements is divided by its
largest magnitude (its ``absmax``, kept in float32), and each quotient, in [-1, 1], is stored
as the uint8 index of a value of a fixed 256-entry "dynamic" map: a signed one for the first
moment, an unsigned one (all 256 codes on [0, 1]) for the second. The map (``dynamic_map``) is
bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``: 7 decades
10^-6..10^0, each holding the midpoints of an even split of [0.1, 1] x the decade, more points
for the larger decades (2^i signed, 2^(i+1) unsigned, i = 0..6), then 0 and 1. Its largest gap
between neighbours: 0.9 / 64 (signed) and 0.9 / 128 (unsigned), in the top decade.

Two choices differ from those libraries, both for what the sharded checkpoint and the step
need:

- Blocks lie within rows: a (rows, ...) tensor's blocks are each row's consecutive runs of
  BLOCK elements (the last one of a row shorter), and the absmax are a (rows, ceil(row /
  BLOCK)) tensor. FSDP2 shards dim 0 (``Shard(0)``, uneven chunks), so every block lies in one
  rank's shard, its absmax is sharded like the parameter's rows, and DCP reshards codes and
  absmax to any world size as it reshards the parameter (bitsandbytes and torchao cut each
  rank's flattened shard into blocks: the blocks change with the world size).
- Stochastic rounding (to one of the two neighbouring map values, the upper with probability
  equal to the distance from the lower over the gap), not rounding to nearest. Each block is
  rescaled at every step, so its largest element is stored exactly and a block whose elements
  all decay (zero gradients) decays exactly; but an element that should decay while its
  block's largest does not (a steady gradient elsewhere in the block) moves by (1 - beta2) =
  0.1% of itself per step, below half the map's relative gap (0.35% and more): rounded to
  nearest, its second moment never decreases (the bf16 case: stochastic_round.py). Rounded
  stochastically the stored value is exact on average. The random numbers come from the
  caller's generator (the step seeds it as for bf16: a resumed run draws the same).
  And a positive second moment is never stored as 0 (it takes the smallest positive code,
  3.25e-7 of its block's absmax): Adam divides by sqrt(v) + eps, and an element of v rounded
  to 0 would step by m / eps.

How it is fast (no search: about 20x the speed of ``torch.searchsorted`` over the map with a
float32 random number per element, and the same neighbours and rounding law; on CPU a C++ loop
per block does the same operations in one pass, kernels.py;
scripts/benchmark_moment_storage.py measures both). A float32
quotient's lower neighbour in the map follows from the top 16 bits of its bit pattern (sign,
exponent, 7 bits of significand): ``_Tables`` holds, for each of the 65536 prefixes, the lower
neighbour's index of the prefix's least float, and the one map value (if any) that lies within
the prefix's range: the map's values are at least 0.7% apart relative to themselves, more than a
prefix spans where they lie (2^-8 of a float in [0.5, 1)), so no prefix holds two (checked when
the tables are built). One compare against that value finishes the search exactly, as
``searchsorted`` would (tests/test_quantize_law.py compares both at every map value and its
float32 neighbours). The random numbers are 16-bit integers, four from each 64-bit draw of the
caller's generator: the upper neighbour is taken when d < up x 2^16 for d uniform on 0..65535,
that is with probability ceil(up x 2^16) / 2^16, from up to up + 2^-16 (up: the distance from
the lower over the gap, in float32; up x 2^16 is exact, the gap being divided by 2^16 in the
table); 0 and 1 exactly for up = 0 and 1. So a stored value's mean is above the exact one by at
most 2^-16 of the gap, 1.5e-5 x 0.9 / 64 of its block's absmax: against the 0.1% per step by
which a decaying second moment moves, nothing. Work is done a chunk of rows at a time (about
CPU_CHUNK elements; CUDA_CHUNK on a GPU) in buffers allocated once (the int32 indices, float32
quotients and gathered map values, 16-bit draws): WORK_BYTES a chunk element, 5 MiB on CPU, 80
MiB on a GPU (allocated anew per chunk they cost a page fault per 4 KiB with
MALLOC_MMAP_THRESHOLD_ set, more than the arithmetic). The eager tensor operations below are the
reference: the C++ kernel (csrc/blockwise_8bit.cpp) computes each chunk with the same float32
operations in the same order, and the same draws, so its codes are theirs bit for bit
(tests/test_quantize_kernel.py); they run on a GPU, and on a CPU where the kernel cannot be
built.

bitsandbytes is not used: its blocks are runs of a flattened tensor, not rows (see above); its
stochastic rounding lives in its CUDA kernels, and its 8-bit optimizers update the moments
themselves (we step with fairseq's Adam); no CPU path of it takes row-aligned blocks.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from ... import chunks
from . import kernels
from .stochastic_round import draws_kept, release_draws
from .thread_buffers import ThreadBuffers

#: elements per block (bitsandbytes' and torchao's block size)
BLOCK = 256
#: tensors with fewer elements (whole parameter, not shard) keep float32 moments, as
#: bitsandbytes' min_8bit_size; so do 1-D ones (biases, layer norms: few elements)
MIN_NUMEL = 4096
#: elements quantized per chunk of rows (at least one row) on CPU: its temporaries stay in the
#: cache (2^18 was the fastest of 2^14..2^21, one thread)
CPU_CHUNK = chunks.QUANTIZE_CPU_ELEMENTS
#: on a GPU: each chunk launches about 20 kernels, and bandwidth, not the cache, is what counts
#: (a chunk of 2^18 would make NLLB-3.3B's step about 50,000 launches)
CUDA_CHUNK = chunks.QUANTIZE_CUDA_ELEMENTS
#: bytes of temporaries per element of a chunk while quantizing: float32 quotients (padded rows)
#: and gathered map values, int32 prefixes and indices, 16-bit draws: 18, and two float32 maxima
#: per block; dequantizing needs fewer (int32 codes: 4)
WORK_BYTES = 20
#: what the estimator allows for these temporaries (estimator/ledger.py): CHUNK x
#: TEMPORARY_BYTES = 128 MiB, a bound on what is used, chunk_elements(device) x WORK_BYTES: 5 MiB
#: on CPU, 80 MiB on a GPU (it predicted the searchsorted version's, whose chunks these were)
CHUNK = chunks.QUANTIZE_ESTIMATED_ELEMENTS
TEMPORARY_BYTES = 64


def chunk_elements(device: torch.device) -> int:
    """Elements quantized at a time on ``device`` (its temporaries: WORK_BYTES each)."""
    return CPU_CHUNK if device.type == "cpu" else CUDA_CHUNK


def rows_at_once(row: int, device: torch.device) -> int:
    """Rows of ``row`` elements quantized (dequantized) at a time on ``device``."""
    return chunks.rows_per_chunk(row, chunk_elements(device))


DECADES = 7
#: bits of a float32's pattern that index the tables (sign, exponent, 7 of the significand)
PREFIX_BITS = 16
#: the upper neighbour is taken when a 16-bit draw d (on 0..65535) < up x DRAWS
DRAWS = float(1 << 16)


@lru_cache(maxsize=None)
def _map_values(signed: bool) -> tuple[float, ...]:
    values = [0.0, 1.0]
    for i in range(DECADES):
        points = 2 ** i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1, points + 1, dtype=torch.float64)
        means = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - DECADES + 1)).tolist()
        values += means + ([-v for v in means] if signed else [])
    assert len(values) == 256
    return tuple(sorted(values))


def dynamic_map(signed: bool, device=None) -> torch.Tensor:
    """The 256 values a code stands for (float32, ascending; one tensor per device, made once:
    no host-to-device copy per call). Not to be modified."""
    return _map_on(signed, torch.device(device or "cpu"))


@lru_cache(maxsize=None)
def _map_on(signed: bool, device: torch.device) -> torch.Tensor:
    return torch.tensor(_map_values(signed), dtype=torch.float32, device=device)


def quantizable(shape: torch.Size) -> bool:
    """Whether a parameter of (global) ``shape`` gets 8-bit moments: 2-D or more, at least
    MIN_NUMEL elements. Decided on the global shape, so alike at every world size."""
    return len(shape) >= 2 and math.prod(shape) >= MIN_NUMEL


def absmax_shape(shape: torch.Size) -> tuple[int, int]:
    """(rows, blocks per row) of the absmax of a tensor of ``shape``."""
    row = math.prod(shape[1:])
    return shape[0], -(-row // BLOCK)


def rows_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` (the block maxima of ``like``'s local rows) as a DTensor laid out as ``like``'s
    rows are: the same mesh and placements (``Shard(0)``), the global rows of ``like``."""
    if not isinstance(like, DTensor):
        return local
    shape = absmax_shape(like.shape)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=torch.Size(shape), stride=(shape[1], 1))


class _Tables:
    """For each 16-bit prefix of a float32 pattern (read as 0..65535): ``low``, the index of the
    lower neighbour in the map (clamped to 0..254, as the upper is low + 1) of the prefix's
    least float; ``after``, a float32 ``b`` such that the prefix's floats above ``b`` have the
    next index (the largest float below the map value inside the prefix's range), or +inf.
    For the unsigned map the least positive float counts as a map value with code 1's index:
    a positive second moment's quotient below the least positive map value then has lower
    neighbour 1 and rounds to it (never to 0). And per index: the map value and its gap to
    the next (1 - q[254] for 254)."""

    def __init__(self, signed: bool, device: torch.device):
        q = torch.tensor(_map_values(signed), dtype=torch.float64)
        bounds = q.clone()
        if not signed:
            bounds[1] = torch.tensor(1, dtype=torch.int32).view(torch.float32).double()
        prefix = torch.arange(1 << PREFIX_BITS, dtype=torch.int64)
        patterns = torch.stack([prefix << 16, (prefix << 16) | 0xFFFF]) - \
            (prefix >= 1 << 15).long() * (1 << 32)  # as int32 values
        ends = patterns.to(torch.int32).view(torch.float32).double()
        # inf and NaN patterns: as values beyond the map, of their sign (quotients are finite)
        ends = torch.where(ends.isfinite(), ends, torch.copysign(torch.tensor(2.0), ends))
        least, most = ends.amin(0), ends.amax(0)

        def index(x):
            return (torch.searchsorted(bounds, x, right=True) - 1).clamp_(0, 254)
        low, high = index(least), index(most)
        assert ((high - low) <= 1).all(), "a prefix holds two map values"
        crossing = bounds[high].float()
        after = torch.nextafter(crossing, torch.tensor(-math.inf))
        self.low = low.to(device, torch.int32)
        self.after = torch.where(high > low, after, math.inf).to(device)
        self.value = q.float().to(device)
        gap = q.float().diff()  # as the float32 difference above - below
        # divided by DRAWS (exact: a power of 2): the quotient is up x DRAWS; index 255 is never
        # a lower neighbour
        self.gap = (torch.cat([gap, gap[-1:]]) / DRAWS).to(device)
        # the C++ kernel reads each pair with one load: (low, after) by prefix, (value, gap)
        # by code, the first in the low 32 bits of an int64
        self.by_prefix = _pairs(self.low, self.after)
        self.by_code = _pairs(self.value, self.gap)


def _pairs(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """int64 entries holding the 32-bit patterns of ``low`` (low half) and ``high``."""
    return (low.view(torch.int32).long() & 0xFFFFFFFF) | (high.view(torch.int32).long() << 32)


@lru_cache(maxsize=None)
def _tables(signed: bool, device: torch.device) -> _Tables:
    return _Tables(signed, device)


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| (a 0-d tensor; x not empty), as ``torch.norm(x, inf)`` but from one min-max
    pass: on CPU the norm takes about 15x as long (fp16 moments' scale: sixteen_bit.py)."""
    least, most = torch.aminmax(x)
    return torch.maximum(most, least.neg()) + 0.0  # + 0.0: never -0.0


def _row_chunks(rows: int, row: int, device: torch.device):
    step = rows_at_once(row, device)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def quantize(x: torch.Tensor, signed: bool, generator: torch.Generator,
             codes: Optional[torch.Tensor] = None, absmax: Optional[torch.Tensor] = None,
             kernel: bool = True, isa: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, rows first) as (uint8 codes shaped like x, float32 absmax of shape
    absmax_shape(x.shape)), into ``codes`` / ``absmax`` if given (contiguous). On CPU the C++
    kernel (kernels.py) computes each chunk where it is built, unless ``kernel`` is False: the
    eager tensor operations, the same results bit for bit. ``isa``: the most capable version
    of the kernel's loop to run (kernels.PLAIN, kernels.AVX512; -1: the best the CPU has)."""
    if x.dtype != torch.float32:
        raise ValueError(f"expected a float32 tensor, got {x.dtype}")
    rows, blocks = absmax_shape(x.shape)
    row = math.prod(x.shape[1:])
    if codes is None:
        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if absmax is None:
        absmax = torch.empty((rows, blocks), dtype=torch.float32, device=x.device)
    if codes.numel() == 0:
        return codes, absmax
    tables = _tables(signed, x.device)
    flat, out = x.reshape(rows, row), codes.view(rows, row)
    step = rows_at_once(row, x.device)
    work = _Workspace.at_least(min(step, rows) * blocks, x.device)
    compiled = _kernel(x.device, kernel)
    for start, end in _row_chunks(rows, row, x.device):
        part, n = flat[start:end], (end - start) * blocks * BLOCK
        if compiled is not None:
            draws = work.draws[:n // 4].random_(-1 << 63, None, generator=generator)
            compiled.quantize_rows(part.contiguous(), draws, tables.by_prefix, tables.by_code,
                                   out[start:end], absmax[start:end], isa)
            continue
        scaled = work.f32a[:n].view(end - start, blocks * BLOCK)
        if blocks * BLOCK != row:  # the last block of each row: zeros after the row's end
            scaled[:, row:] = 0
            scaled[:, :row] = part
            part = scaled
        part = part.reshape(end - start, blocks, BLOCK)
        peak = absmax[start:end]
        least = work.least[:(end - start) * blocks].view_as(peak)
        torch.amax(part, -1, out=peak)
        torch.amin(part, -1, out=least)
        torch.maximum(peak, least.neg_(), out=peak).add_(0.0)  # + 0.0: no -0.0 maxima
        # |x| <= peak, so the correctly rounded quotient lies in [-1, 1]
        torch.div(part, least.copy_(peak).clamp_min_(torch.finfo(torch.float32).tiny)
                  .unsqueeze(-1), out=scaled.view(end - start, blocks, BLOCK))
        s = scaled.view(-1)
        prefix, low, other = work.i32a[:n], work.i32b[:n], work.f32b[:n]
        torch.bitwise_right_shift(s.view(torch.int32), 32 - PREFIX_BITS, out=prefix)
        prefix.bitwise_and_((1 << PREFIX_BITS) - 1)
        torch.index_select(tables.low, 0, prefix, out=low)
        torch.index_select(tables.after, 0, prefix, out=other)
        low.sub_(_negative(other.sub_(s)))  # + 1 where s > after: searchsorted's neighbour
        s.sub_(torch.index_select(tables.value, 0, low, out=other))
        s.div_(torch.index_select(tables.gap, 0, low, out=other))  # up x DRAWS
        draws = work.draws[:n // 4].random_(-1 << 63, None, generator=generator)
        other.copy_(draws.view(torch.uint16))  # exact: integers below 2^16
        low.sub_(_negative(other.sub_(s)))  # + 1 where d < up x DRAWS
        out[start:end] = low.view(end - start, blocks * BLOCK)[:, :row]
    return codes, absmax


def _kernel(device: torch.device, wanted: bool):
    """The C++ kernels' module for a CPU tensor, where built and ``wanted``; else None."""
    return kernels.blockwise_8bit() if wanted and device.type == "cpu" else None


def _negative(x: torch.Tensor) -> torch.Tensor:
    """-1 (int32) where ``x`` (float32, overwritten) is negative, else 0: the sign bit,
    spread by an arithmetic shift. A difference a - b of floats is negative exactly when a < b
    (it is 0 only when they are equal, and rounding keeps its sign). Comparing and adding the
    bool instead would convert it to a temporary int32 tensor per call."""
    return x.view(torch.int32).bitwise_right_shift_(31)


class _Workspace:
    """quantize's temporaries for ``blocks`` blocks (and dequantize's int32 codes). On CPU one
    is kept between calls, the largest asked for (CPU_CHUNK elements' worth, 5 MiB, unless a single
    row is longer): a new buffer costs a page fault per 4 KiB under MALLOC_MMAP_THRESHOLD_, 2.7
    us each on this project's machines (VMs), as long as quantizing 600 elements, so a
    workspace made per call cost as much as quantizing a 512 x 1024 shard. On a GPU the caching
    allocator keeps its blocks: one per call."""

    #: per thread (two threads quantizing at once never share one): the kept workspace;
    #: every thread's dropped by release_workspaces at the end of a run (the process is the
    #: user's)
    kept = ThreadBuffers()

    @classmethod
    def at_least(cls, blocks: int, device: torch.device) -> "_Workspace":
        if device.type != "cpu":
            return cls(blocks, device)
        work = cls.kept.get()
        if work is None or work.blocks < blocks:
            work = cls(blocks, device)
            cls.kept.put(work)
        return work

    @classmethod
    def int32(cls, elements: int, device: torch.device) -> torch.Tensor:
        """An int32 buffer of at least ``elements`` (dequantize's codes)."""
        if device.type != "cpu":
            return torch.empty(elements, dtype=torch.int32, device=device)
        return cls.at_least(-(-elements // BLOCK), device).i32a

    def __init__(self, blocks: int, device: torch.device):
        self.blocks = blocks
        n = blocks * BLOCK
        self.f32a = torch.empty(n, dtype=torch.float32, device=device)
        self.f32b = torch.empty(n, dtype=torch.float32, device=device)
        self.i32a = torch.empty(n, dtype=torch.int32, device=device)
        self.i32b = torch.empty(n, dtype=torch.int32, device=device)
        self.draws = torch.empty(n // 4, dtype=torch.int64, device=device)  # BLOCK: 4 | n
        self.least = torch.empty(blocks, dtype=torch.float32, device=device)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
               out: Optional[torch.Tensor] = None, kernel: bool = True) -> torch.Tensor:
    """The float32 values that ``codes`` and ``absmax`` (``quantize``'s) stand for (on CPU by
    the C++ kernel where it is built and ``kernel``: the same values)."""
    rows, blocks = absmax_shape(codes.shape)
    row = math.prod(codes.shape[1:])
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if out.numel() == 0:
        return out
    qmap = dynamic_map(signed, codes.device)
    flat, dest = codes.reshape(rows, row), out.view(rows, row)
    compiled = _kernel(codes.device, kernel)
    if compiled is not None:
        compiled.dequantize_rows(flat.contiguous(), absmax.contiguous(), qmap, dest)
        return out
    step = rows_at_once(row, codes.device)
    index = _Workspace.int32(min(step, rows) * row, codes.device)
    for start, end in _row_chunks(rows, row, codes.device):
        n = (end - start) * row
        index[:n].view(end - start, row).copy_(flat[start:end])
        values = torch.index_select(qmap, 0, index[:n], out=dest[start:end].view(-1))
        scale = absmax[start:end].unsqueeze(-1)
        if blocks * BLOCK == row:
            values.view(end - start, blocks, BLOCK).mul_(scale)
        else:  # whole blocks, then each row's last
            rows_ = values.view(end - start, row)
            whole = (blocks - 1) * BLOCK
            rows_[:, :whole].view(end - start, blocks - 1, BLOCK).mul_(scale[:, :-1])
            rows_[:, whole:].mul_(scale[:, -1])
    return out


def release_workspaces() -> None:
    """Drop what the moments' code keeps between calls: every thread's CPU buffers (quantize's
    workspace, the bf16 rounding's draws) and the per-device tables (CUDA memory too). The
    trainer has its run's context call it at the run's end (launch/run_context.py)."""
    _Workspace.kept.clear()
    release_draws()
    _map_on.cache_clear()
    _tables.cache_clear()


def kept_state() -> dict:
    """What release_workspaces drops, counted (tests/probes/in_process.py checks a run leaves
    none of it)."""
    return {"workspaces": len(_Workspace.kept), "draws": draws_kept(),
            "tables": _map_on.cache_info().currsize + _tables.cache_info().currsize}
