"""float32 to bfloat16 with stochastic rounding, from a seeded generator.

Why not round to nearest: bf16 keeps 8 significant bits, so half a unit in the last place is
2^-9 to 2^-8 of a value. Adam's second moment moves by (1 - beta2) = 0.1% of itself per step
(beta2 = 0.999): rounded to nearest, a second moment that should decay (smaller gradients)
rounds back to itself at every step and never decreases, and one that should grow does so only
when the squared gradient exceeds about 3x the moment. Rounded up with probability equal to
the fraction cut off, each stored value is exact on average, and the decay is kept.

How: a float32's bit pattern read as an int32 has the bf16 value in its high 16 bits. Adding a
uniform random integer in [0, 2^16) to the pattern and clearing the low 16 bits rounds the
magnitude up with probability (low bits) / 2^16, else down (a carry runs into the exponent as
it should; the sign bit is untouched for finite values). The random integers come from a
generator seeded by the caller (the step: the run's seed, the step, the parameter, the shard),
so a run and its resumed copy draw the same numbers, and nothing needs saving. They
are the four 16-bit quarters of 64-bit draws (``random_`` over int64's whole range), read as
int16 and widened with their low 16 bits kept: uniform on [0, 2^16) as a 32-bit draw per
element would be, at a quarter of the generator's work (a 16-bit ``randint`` costs a 32-bit
draw per element, five times as long as the rest of the rounding). On CPU the buffers are
kept between calls (6 MiB): with MALLOC_MMAP_THRESHOLD_ set each new buffer costs a page fault
per 4 KiB, 2.7 us each on this project's machines, more than rounding the 4 KiB.
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import chunks
from .thread_buffers import ThreadBuffers

#: Elements rounded per batch of random integers: the integers (int32, and their 64-bit draws)
#: are the only temporaries, 6 bytes an element of a batch, whatever the tensor's size.
CHUNK = chunks.ROUND_ELEMENTS
LOW_BITS = 1 << 16
HIGH_MASK = -LOW_BITS  # 0xFFFF0000 as an int32


def generator_for(device: torch.device, seed: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def to_bf16_stochastic(x: torch.Tensor, generator: torch.Generator,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` (float32) rounded stochastically to bfloat16, into ``out`` if given (a contiguous
    bf16 tensor of x's shape). A contiguous ``x`` is used as scratch space: its contents are
    undefined afterwards."""
    if x.dtype != torch.float32:
        raise ValueError(f"expected a float32 tensor, got {x.dtype}")
    x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    bits, dest = x.view(-1).view(torch.int32), out.view(-1)
    draws, noise = _buffers(min(CHUNK, -(-bits.numel() // 4) * 4), x.device)
    for start in range(0, bits.numel(), CHUNK):
        part = bits[start:start + CHUNK]
        n = part.numel()
        draws[:-(-n // 4)].random_(-1 << 63, None, generator=generator)
        low = noise[:n].copy_(draws.view(torch.int16)[:n]).bitwise_and_(LOW_BITS - 1)
        part.add_(low).bitwise_and_(HIGH_MASK)
        dest[start:start + CHUNK].copy_(part.view(torch.float32))  # exact: low bits are zero
    return out


#: per thread (two threads rounding at once never share them): (64-bit draws, int32 noise),
#: CHUNK elements' worth, every thread's dropped by release_draws at the end of a run
_kept = ThreadBuffers()


def _buffers(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 draws for ``size`` elements, int32 noise of ``size``); on CPU kept between calls
    (the module docstring says why), on a GPU the caching allocator's."""
    kept = _kept.get() if device.type == "cpu" else None
    if kept is None or kept[1].numel() < size:
        kept = (torch.empty(-(-size // 4), dtype=torch.int64, device=device),
                torch.empty(size, dtype=torch.int32, device=device))
        if device.type == "cpu":
            _kept.put(kept)
    return kept


def draws_kept() -> int:
    """The threads holding kept CPU buffers."""
    return len(_kept)


def release_draws() -> None:
    """Drop every thread's kept CPU buffers (blockwise_8bit.release_workspaces)."""
    _kept.clear()
