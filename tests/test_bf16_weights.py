"""bf16 weights with no float32 master copy (``--memory-efficient-bf16`` under FSDP2:
settings.keeps_bf16_weights; the write-back in optimizer/row_chunk_step.py).

In one process, the rounding law of the weight update: the plugin's Adam steps a bf16 parameter
as fairseq's Adam steps its float32 copy (the widening is exact, the arithmetic the same: the
same float32 result x, bit for bit), then stores x rounded stochastically: one of x's two bf16
neighbours, the upper with probability (x - lower) / (upper - lower), unbiased within its gap.

Then fairseq-train on two ranks (below): fine-tuning a trained model at an NLLB fine-tuning
learning rate, the bf16-weight run against the float32-master run within the spread of its own
rounding, where rounding to nearest fails; the checkpoint's bf16 weights, exact resume, resume
at another world size and the consolidated export.
"""
from __future__ import annotations

import math

import torch

from moment_bounds import plugin_adam

#: the rows of the law's parameter: R stores of every input (each row the same inputs, its own
#: draws: the stream's consecutive 16-bit draws are independent and uniform)
R = 4096
#: the false-failure probability the bands are drawn for
DELTA = 1e-9


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values next to each float32 x: below (or equal) and above (x's bit pattern with
    its low 16 bits cleared, and that plus one bf16 unit, toward larger magnitudes)."""
    bits = x.view(torch.int32)
    low = (bits & -(1 << 16)).view(torch.float32)
    high = (bits.to(torch.int64) + (1 << 16)).to(torch.int32) & -(1 << 16)
    return low, high.view(torch.float32)


def law_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weights, bf16 gradients) of M elements: weights over eight binades (1/64 to 2),
    both signs, gradients of both signs: Adam's first step moves each by about lr (its update
    is lr m / (sqrt(v) + eps), m and sqrt(v) both |g| times their bias corrections), from far
    below a bf16 unit of the weight (2^-14 to 2^-7 of it at lr 1e-4) to near it."""
    g = torch.Generator().manual_seed(0)
    m = 512
    magnitude = 2.0 ** (torch.rand(m, generator=g) * 7 - 6)
    sign = torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0)
    grad = torch.randn(m, generator=g)
    return (sign * magnitude).bfloat16(), grad.bfloat16()


def test_weight_update_rounds_stochastically_unbiased_within_its_gap():
    """R rows of the same M weights and gradients stepped once by the plugin's Adam with bf16
    weights (lr 1e-4) and once, as float32, by the same Adam with float32 weights (the master
    copy's step: x). Every stored weight is one of x's two bf16 neighbours (x itself where x is
    a bf16 value). In frequency: the count K of upper neighbours among R is Binomial(R, p) with
    p = (x - lower) / (upper - lower) exactly (the rounding adds a uniform 16-bit integer to
    x's low 16 bits: up with probability low / 2^16, which is p), so by Bernstein,
    P(|K - R p| >= a) <= 2 exp(-a^2 / (2 (R p (1 - p) + a / 3))): with a = L / 3 +
    sqrt(L^2 / 9 + 2 R p (1 - p) L), L = ln(2 M / DELTA), no input leaves its band except with
    probability DELTA (union bound over the M inputs). Rounding to nearest puts K at 0 or R
    (outside the band for any p away from 0 and 1), a dropped write-back leaves the old weight
    (K always 0 or always R, likewise)."""
    weights, grads = law_inputs()
    m = weights.numel()
    ours = weights.repeat(R, 1).requires_grad_()
    ours.grad = grads.repeat(R, 1)
    master = weights.float().repeat(R, 1).requires_grad_()
    master.grad = grads.float().repeat(R, 1)
    plugin_adam([ours], lr=1e-4, bf16_weights=True).step()
    plugin_adam([master], lr=1e-4).step()
    ours, master = ours.detach(), master.detach()
    x = master[0]
    assert torch.equal(master, x.expand_as(master))  # every row stepped alike
    assert (x != weights.float()).all()  # every weight moved (in float32)
    low, high = neighbours(x)
    stored = ours.float()
    exact = low == x
    is_upper = stored == high
    assert ((stored == low) | is_upper).all(), "a weight stored off its two neighbours"
    assert (stored[:, exact] == x[exact]).all()
    p = torch.where(exact, 0.0, (x.double() - low.double()) / (high.double() - low.double()))
    count = is_upper.sum(0).double()
    log = math.log(2 * m / DELTA)
    band = log / 3 + torch.sqrt(log ** 2 / 9 + 2 * R * p * (1 - p) * log)
    off = (count - R * p).abs()
    worst = (off - band).max().item()
    moved = (stored != weights.float()).double().mean().item()
    print(f"{m} inputs, {R} stores each: largest |K - R p| {off.max():.0f}, closest to its "
          f"band by {-worst:.1f}; {moved:.1%} of the stored weights moved")
    assert worst <= 0, (x[(off - band).argmax()], p[(off - band).argmax()])
