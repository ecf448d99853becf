"""The fast 8-bit quantization (optimizer/blockwise_8bit.py: prefix tables, 16-bit draws) keeps
the rounding law of the search it replaced: each quotient s rounds to one of its two map
neighbours as ``torch.searchsorted`` finds them (the largest map value <= s, index clamped to
0..254, and the next), the upper with probability up = (s - lower) / (upper - lower); a positive
quotient of the unsigned map never to code 0. The reference below is that search, written out.

Inputs: for every map interval [q_k, q_k+1], q_k itself (up = 0), the float32 just above it
(the crossing a prefix table must find), a third of the way in, and the float32 just below
q_k+1; the decades' edges 10^-j (not map values: the even splits change there) and their
float32 neighbours; 0, -0, the least positive (denormal) float, a quotient below the unsigned
map's least positive value, and (signed) quotients below its least value -0.993. Each row of
BLOCK elements starts with 1.0, so its absmax is 1 and every quotient is its element exactly.

Checked for every draw: the code is the lower or the upper neighbour, the lower where up = 0,
the upper where up = 1, code 1 for 0 < s < q_1 (unsigned). Checked in frequency: R stores of
each input; the count K of upper codes is Binomial(R, p) with |p - up| <= 2^-16 + 2^-20 (the
16-bit draws, blockwise_8bit.py: p = ceil(up x 2^16) / 2^16; up computed in float32 is within a
few U32 of the exact up used here, 2^-20 covers it). Bernstein: P(|K - R p| >= a) <= 2 exp(-a^2
/ (2 (R p (1 - p) + a / 3))), so with a = L / 3 + sqrt(L^2 / 9 + 2 R p (1 - p) L), L = ln(2 M /
1e-9), no input of the M tested leaves its band except with probability 1e-9 for any seed (union
bound; M < 2200, L < 29.1). R = 4096: a is at most 0.08 R (p = 1/2); for a p of 0 or 1 the count
is exact (a = 0: those inputs are the deterministic checks). A wrong neighbour, rounding to
nearest or the complement 1 - up is off by far more (tried by hand: the commit says what it
printed).
"""
from __future__ import annotations

import math

import torch

from fairseq_fsdp2.optimizer.moments.blockwise_8bit import BLOCK, dynamic_map, quantize

#: stores of every input
R = 4096
#: the false-failure probability the bands are drawn for
DELTA = 1e-9
#: the 16-bit draws' resolution, and float32's rounding of up (blockwise_8bit.py)
RESOLUTION = 2.0 ** -16 + 2.0 ** -20


def _next(x: torch.Tensor, toward: float) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, toward))


def inputs(signed: bool) -> torch.Tensor:
    q = dynamic_map(signed)
    lower, upper = q[:-1], q[1:]
    third = (lower.double() + (upper.double() - lower.double()) / 3).float()
    edges = torch.tensor([10.0 ** -j for j in range(7)])
    edges = torch.cat([edges, -edges]) if signed else edges
    special = [0.0, -0.0, 1e-45, q[1].item() / 2, 1e-40]
    if signed:
        special += [-1.0, _next(q[:1], -2.0).item(), -0.9999]
    x = torch.cat([lower, _next(lower, 2.0), third, _next(upper, -2.0), edges,
                   _next(edges, 2.0), _next(edges, -2.0), torch.tensor(special)])
    return x[(x >= -1) & (x <= 1)]


def searchsorted_law(s: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower neighbour's index, probability of the upper one) as the search defined them;
    for the unsigned map's positive quotients below q_1: index 1, probability 0 (code 1)."""
    q = dynamic_map(signed)
    low = (torch.searchsorted(q, s, right=True) - 1).clamp(0, 254)
    q64 = q.double()
    up = ((s.double() - q64[low]) / (q64[low + 1] - q64[low])).clamp(0, 1)
    if not signed:
        tiny = (low == 0) & (s > 0)
        low, up = torch.where(tiny, 1, low), torch.where(tiny, 0.0, up)
    return low, up


def band(p: torch.Tensor, m: int) -> torch.Tensor:
    """Bernstein's a for each p (module docstring), widened by the draws' resolution."""
    log = math.log(2 * m / DELTA)
    p_hi = (p + RESOLUTION).clamp(max=1)
    var = R * p_hi * (1 - p_hi).clamp(min=0) + R * RESOLUTION
    return log / 3 + torch.sqrt(log ** 2 / 9 + 2 * var * log) + R * RESOLUTION


def test_fast_quantize_picks_searchsorted_neighbours_with_the_same_law():
    g = torch.Generator().manual_seed(0)
    for signed in (True, False):
        s = inputs(signed)
        m = s.numel()
        assert m < 2200
        per_row = BLOCK - 1
        rows = -(-m // per_row)
        block = torch.zeros(rows, per_row)
        block.view(-1)[:m] = s
        block = torch.cat([torch.ones(rows, 1), block], 1)  # absmax 1: quotient = element
        codes, absmax = quantize(block.repeat(R, 1), signed, g)
        assert torch.equal(absmax, torch.ones(rows * R, 1))
        codes = codes.view(R, rows, BLOCK)[:, :, 1:].reshape(R, -1)[:, :m].long()
        low, up = searchsorted_law(s, signed)
        is_upper = codes == low + 1
        assert ((codes == low) | is_upper).all(), \
            s[~((codes == low) | is_upper).all(0)][:5]
        assert (codes[:, up == 0] == low[up == 0]).all()
        assert (codes[:, up == 1] == low[up == 1] + 1).all()
        count = is_upper.sum(0).double()
        off = (count - R * up).abs()
        worst = (off - band(up, m)).max().item()
        print(f"signed={signed}: {m} inputs, {R} stores; largest |K - R up| {off.max():.0f}, "
              f"closest to its band by {-worst:.1f}")
        assert worst <= 0, s[(off - band(up, m)).argmax()]
