"""Block-wise 8-bit quantization of Adam's moments (``--eight-bit-adam-stats``, adam_stats.py).

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
  caller's generator (adam_stats.py seeds it as for bf16: a resumed run draws the same).
  And a positive second moment is never stored as 0 (it takes the smallest positive code,
  3.25e-7 of its block's absmax): Adam divides by sqrt(v) + eps, and an element of v rounded
  to 0 would step by m / eps.

Work is done a chunk of rows at a time (about CHUNK elements): the temporaries (int64 indices,
float32 quotients and random numbers) stay below CHUNK x TEMPORARY_BYTES = 128 MiB whatever the
parameter's size.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

#: elements per block (bitsandbytes' and torchao's block size)
BLOCK = 256
#: tensors with fewer elements (whole parameter, not shard) keep float32 moments, as
#: bitsandbytes' min_8bit_size; so do 1-D ones (biases, layer norms: few elements)
MIN_NUMEL = 4096
#: elements quantized per chunk of rows (at least one row)
CHUNK = 1 << 21
#: at most this many bytes of temporaries per element of a chunk while quantizing (int64
#: indices and codes, float32 quotients, neighbours and random numbers, a padded copy): 56,
#: rounded up; dequantizing needs fewer (an int64 index and float32 values: 16)
TEMPORARY_BYTES = 64
DECADES = 7


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


def _row_chunks(rows: int, row: int):
    step = max(1, CHUNK // max(row, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def quantize(x: torch.Tensor, signed: bool, generator: torch.Generator,
             codes: Optional[torch.Tensor] = None, absmax: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, rows first) as (uint8 codes shaped like x, float32 absmax of shape
    absmax_shape(x.shape)), into ``codes`` / ``absmax`` if given (contiguous)."""
    if x.dtype != torch.float32:
        raise ValueError(f"expected a float32 tensor, got {x.dtype}")
    rows, blocks = absmax_shape(x.shape)
    row = math.prod(x.shape[1:])
    qmap = dynamic_map(signed, x.device)
    if codes is None:
        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if absmax is None:
        absmax = torch.empty((rows, blocks), dtype=torch.float32, device=x.device)
    flat, out = x.reshape(rows, row), codes.view(rows, row)
    pad = blocks * BLOCK - row
    for start, end in _row_chunks(rows, row):
        part = flat[start:end]
        part = F.pad(part, (0, pad)) if pad else part
        part = part.reshape(end - start, blocks, BLOCK)
        peak = part.abs().amax(-1)
        absmax[start:end] = peak
        # |x| <= peak, so the correctly rounded quotient lies in [-1, 1]
        scaled = part / peak.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        low = (torch.searchsorted(qmap, scaled, right=True) - 1).clamp_(0, 254)
        below, above = qmap[low], qmap[low + 1]
        up = (scaled - below) / (above - below)  # < 0 below the signed map's least value
        draw = torch.rand(scaled.shape, generator=generator, device=x.device)
        code = low + (draw < up)
        if not signed:  # a positive second moment never becomes 0 (see the docstring)
            code = torch.where((code == 0) & (scaled > 0), 1, code)
        out[start:end] = code.reshape(end - start, blocks * BLOCK)[:, :row]
    return codes, absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 values that ``codes`` and ``absmax`` (``quantize``'s) stand for."""
    rows, blocks = absmax_shape(codes.shape)
    row = math.prod(codes.shape[1:])
    qmap = dynamic_map(signed, codes.device)
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    flat, dest = codes.reshape(rows, row), out.view(rows, row)
    pad = blocks * BLOCK - row
    for start, end in _row_chunks(rows, row):
        values = qmap[flat[start:end].long()]
        values = F.pad(values, (0, pad)) if pad else values
        values = values.view(end - start, blocks, BLOCK).mul_(absmax[start:end].unsqueeze(-1))
        dest[start:end] = values.view(end - start, blocks * BLOCK)[:, :row]
    return out
