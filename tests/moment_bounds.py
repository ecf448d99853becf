"""Adam's moments stored in 16 or 8 bits against float32 moments, element by element, on any
device: the plugin's Adam (optimizer/build.py) and a float32 one fed the same gradients, every
stored moment (and, for 8 bits, every parameter) after every step within a bound computed from
the values. The bounds are derived in tests/test_adam_stats.py (16 bits) and
tests/test_adam_stats_8bit.py (8 bits), which run these on the CPU; tests/test_cuda_step.py
runs them on a GPU at production sizes (the CUDA path: eager quantization, stochastic rounding
drawn per kernel launch)."""
from __future__ import annotations

import math

import torch
from fairseq.optim.adam import FairseqAdamConfig
from omegaconf import OmegaConf

from numerics import U32

from fairseq_fsdp2.optimizer.moments.blockwise_8bit import (BLOCK, dequantize, dynamic_map,
                                                            quantizable)
from fairseq_fsdp2.optimizer.moments.eight_bit import ABSMAX_KEYS
from fairseq_fsdp2.optimizer.moments.sixteen_bit import SCALE_KEYS
from fairseq_fsdp2.optimizer.build import build_optimizer

BETAS = (0.9, 0.999)
EPS = 1e-8
LR = 1e-3


def plugin_adam(params, stats: str = "fp32", lr: float = LR, betas=BETAS,
                eps: float = EPS, bf16_weights: bool = False,
                seed: int = 1) -> torch.optim.Optimizer:
    """The plugin's Adam (fairseq's, as build_optimizer makes it) over ``params`` with its
    moments stored as ``stats``: fp32, fp16 (--fp16-adam-stats), bf16 or 8bit;
    ``bf16_weights``: --memory-efficient-bf16 (bf16 parameters, updates rounded
    stochastically from ``seed``'s streams)."""
    cfg = OmegaConf.create({
        "common": {"fp16": False, "seed": seed, "memory_efficient_bf16": bf16_weights},
        "optimization": {"update_freq": [1]},
        "distributed_training": {"bf16_adam_stats": stats == "bf16",
                                 "eight_bit_adam_stats": stats == "8bit"},
        "optimizer": OmegaConf.structured(FairseqAdamConfig(
            _name="adam", lr=[lr], adam_betas=betas, adam_eps=eps, tpu=False,
            fp16_adam_stats=stats == "fp16"))})
    return build_optimizer(cfg, params).optimizer


def gap_of(signed: bool) -> float:
    """G: the largest distance of a value in [-1, 1] (signed) or [0, 1] to the map value a code
    may round it to: the largest gap between neighbours, or (signed) below the least value."""
    q = dynamic_map(signed).double()
    return max(q.diff().max().item(), (1 + q[0]).item() if signed else 0.0)


def effective(state: dict, key: str) -> torch.Tensor:
    """A 16-bit moment's float32 value (fp16's times its scale)."""
    scale = state.get(SCALE_KEYS[key])
    value = state[key].float()
    return value * scale if scale is not None else value


def block_max(x: torch.Tensor) -> torch.Tensor:
    """The largest element of each 8-bit block of ``x`` (rows x row, non-negative): rows x
    blocks, as the stored maxima are laid out (the last block of a row may be shorter)."""
    blocks = -(-x.shape[1] // BLOCK)
    padded = torch.nn.functional.pad(x, (0, blocks * BLOCK - x.shape[1]))
    return padded.view(x.shape[0], blocks, BLOCK).amax(-1)


def spread_gradients(shapes: dict, steps: int, device: torch.device, seed: int = 0,
                     decades: int = 4):
    """``steps`` gradients for the parameters ``shapes`` (name -> shape), the same numbers on
    every device (drawn on the CPU): normal, and for a 2-D or larger parameter scaled along its
    last dimension by 10^-decades .. 1 (its moments then span twice as many decades)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = {}
        for name, shape in shapes.items():
            g = torch.randn(shape, generator=generator)
            if len(shape) >= 2:
                g = g * torch.logspace(-decades, 0, shape[-1])
            grads[name] = g.to(device)
        yield grads


def assert_16_bit_moments_within_bound(device: torch.device, stats: str, shapes: dict,
                                       store: float, steps: int = 30) -> None:
    """--fp16-adam-stats / --bf16-adam-stats (``stats``; ``store``: the relative rounding of
    one store, numerics.FP16_MOMENT / BF16_MOMENT) against float32 moments: every element of
    both moments after every step within the bound of tests/test_adam_stats.py."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[stats]
    ours = {k: torch.nn.Parameter(torch.zeros(s, device=device)) for k, s in shapes.items()}
    ref = {k: torch.nn.Parameter(torch.zeros(s, device=device)) for k, s in shapes.items()}
    opt, ref_opt = plugin_adam(list(ours.values()), stats), plugin_adam(list(ref.values()))
    zeros = {k: torch.zeros(s, device=device) for k, s in shapes.items()}
    bound = {(k, key): zeros[k] for k in shapes for key in SCALE_KEYS}
    before = {(k, key): (zeros[k], zeros[k]) for k in shapes for key in SCALE_KEYS}
    for t, grads in enumerate(spread_gradients(shapes, steps, device, decades=3), start=1):
        for k, g in grads.items():
            ours[k].grad, ref[k].grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for k, g in grads.items():
            state, ref_state = opt.state[ours[k]], ref_opt.state[ref[k]]
            for key, beta, term in (("exp_avg", BETAS[0], g.abs()),
                                    ("exp_avg_sq", BETAS[1], g.square())):
                assert state[key].dtype == dtype and state[key].device == device
                assert (SCALE_KEYS[key] in state) == (stats == "fp16")
                got, want = effective(state, key), ref_state[key]
                # both runs compute beta x m + (1 - beta) x term in float32 (at most 4
                # roundings of these magnitudes), from stored values that differ by the
                # previous bound
                mine, theirs = before[k, key]
                pre = beta * bound[k, key] + 4 * U32 * (beta * (mine.abs() + theirs.abs())
                                                        + 2 * (1 - beta) * term)
                # then ours is stored: relative `store`, and fp16's underflow (a scaled value
                # below 2^-24 rounds to a multiple of 2^-24: half of it, times the scale)
                floor = float(state[SCALE_KEYS[key]]) * 2.0 ** -25 * (1 + 4 * U32) \
                    if stats == "fp16" else 0.0
                bound[k, key] = pre + store * (want.abs() + pre) + floor
                excess = ((got - want).abs() - bound[k, key]).max().item()
                assert excess <= 0, f"step {t} {k} {key}: {excess} beyond the bound"
                before[k, key] = (got, want)
    # the bound is not vacuous: the 16-bit moments do differ, by far less than themselves
    for k in shapes:
        m, m32 = effective(opt.state[ours[k]], "exp_avg"), ref_opt.state[ref[k]]["exp_avg"]
        assert 0 < (m - m32).abs().max() < 0.05 * m32.abs().max(), k


def assert_8_bit_steps_within_bound(device: torch.device, shapes: dict,
                                    steps: int = 30) -> None:
    """--eight-bit-adam-stats against float32 moments over parameters ``shapes`` (name ->
    shape) on ``device``: after every step each moment element of a quantizable parameter
    within the bound of tests/test_adam_stats_8bit.py's docstring, and each of its parameter
    elements within the sum of the steps' bounds; a parameter too small or 1-D keeps float32
    moments, equal to the float32 run's bit for bit."""
    ours = {k: torch.nn.Parameter(torch.zeros(s, device=device)) for k, s in shapes.items()}
    ref = {k: torch.nn.Parameter(torch.zeros(s, device=device)) for k, s in shapes.items()}
    opt, ref_opt = plugin_adam(list(ours.values()), "8bit"), plugin_adam(list(ref.values()))
    # a quantizable parameter's rows (blocks lie within them), as a 2-D view
    rows = {k: (s[0], math.prod(s[1:])) for k, s in shapes.items() if quantizable(torch.Size(s))}
    assert rows and len(rows) < len(shapes)  # both kinds
    flat = lambda x, k: x.detach().reshape(rows[k])  # noqa: E731
    gap = {"exp_avg": gap_of(True), "exp_avg_sq": gap_of(False)}
    zeros = {k: torch.zeros(r, device=device) for k, r in rows.items()}
    bound = {(k, key): zeros[k] for k in rows for key in gap}
    stored = {(k, key): (zeros[k], zeros[k]) for k in rows for key in gap}
    param_bound = dict(zeros)
    b1, b2 = BETAS
    for t, grads in enumerate(spread_gradients(shapes, steps, device), start=1):
        for k, g in grads.items():
            ours[k].grad, ref[k].grad = g.clone(), g.clone()
        before = {k: (flat(ours[k], k).clone(), flat(ref[k], k).clone()) for k in rows}
        opt.step()
        ref_opt.step()
        lr_t = LR * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        for k in rows:
            state, ref_state = opt.state[ours[k]], ref_opt.state[ref[k]]
            g = flat(grads[k], k)
            pre = {}
            for key, beta, term in (("exp_avg", b1, g.abs()), ("exp_avg_sq", b2, g.square())):
                assert state[key].dtype == torch.uint8 and state[key].device == device
                mine, theirs = stored[k, key]
                pre[key] = beta * bound[k, key] + 4 * U32 * (beta * (mine.abs() + theirs.abs())
                                                             + 2 * (1 - beta) * term)
                absmax = state[ABSMAX_KEYS[key]]
                # the block maxima are those of our float32 moment, elementwise within pre of
                # the reference's: a maximum moves by at most the largest of its elements'
                # moves (plus 2 U32 for this float32 subtraction and its comparison); a wrong
                # maximum would otherwise widen the bound below with it, unseen
                want = flat(ref_state[key], k)
                moved = block_max(pre[key])
                excess = ((absmax - block_max(want.abs())).abs()
                          - moved - 2 * U32 * (absmax + moved)).max().item()
                assert excess <= 0, f"step {t} {k} {key}: a block maximum off by {excess}"
                got = flat(dequantize(state[key], absmax, key == "exp_avg"), k)
                a = absmax.repeat_interleave(BLOCK, 1)[:, :rows[k][1]]
                bound[k, key] = pre[key] + (gap[key] + 2 * U32) * a
                excess = ((got - want).abs() - bound[k, key]).max().item()
                assert excess <= 0, f"step {t} {k} {key}: {excess} beyond the bound"
                stored[k, key] = (got, want)
            # the step: from the float32 moments of this step (ref's, and ours within pre)
            m, v = flat(ref_state["exp_avg"], k), flat(ref_state["exp_avg_sq"], k)
            v_low = (v - pre["exp_avg_sq"]).clamp_min(0).sqrt()
            step = lr_t * (pre["exp_avg"] / (v_low + EPS) + m.abs() * pre["exp_avg_sq"] / (
                (v_low + v.sqrt()).clamp_min(1e-30) * (v_low + EPS) * (v.sqrt() + EPS)))
            update = lr_t * (m.abs() + pre["exp_avg"]) / (v_low + EPS)  # either run's, at most
            mine, theirs = before[k]
            param_bound[k] = param_bound[k] + step + 6 * U32 * (2 * update + mine.abs()
                                                                + theirs.abs())
            excess = ((flat(ours[k], k) - flat(ref[k], k)).abs() - param_bound[k]).max().item()
            assert excess <= 0, f"step {t} {k} parameter: {excess} beyond the bound"
        for k in shapes.keys() - rows.keys():  # float32 moments, as the reference's
            for key in gap:
                assert opt.state[ours[k]][key].dtype == torch.float32
                assert torch.equal(opt.state[ours[k]][key], ref_opt.state[ref[k]][key]), (t, k)
            assert ABSMAX_KEYS["exp_avg"] not in opt.state[ours[k]]
    # not vacuous: the 8-bit moments differ, by far less than the largest moment
    for k in rows:
        state = opt.state[ours[k]]
        m8 = dequantize(state["exp_avg"], state[ABSMAX_KEYS["exp_avg"]], True)
        m32 = ref_opt.state[ref[k]]["exp_avg"]
        assert 0 < (m8 - m32).abs().max() < 0.05 * m32.abs().max(), k


def assert_bf16_second_moment_decays(device: torch.device) -> None:
    """tests/test_adam_stats.py's decay test (its docstring derives eps) on ``device``: 50 steps
    of gradients +-1 then 250 of zero over 4096 elements; the mean of the bf16 second moment
    within eps of the exact decay, which bf16 rounded to nearest (the control) misses."""
    n, up, down = 4096, 50, 250
    ours = torch.nn.Parameter(torch.zeros(n, device=device))
    opt = plugin_adam([ours], "bf16")
    nearest = torch.zeros(n, dtype=torch.bfloat16)  # v stored rounded to nearest
    exact = 0.0  # every element's v in exact arithmetic (g^2 = 1, then 0)
    generator = torch.Generator().manual_seed(0)
    for t in range(up + down):
        g = torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1 if t < up else \
            torch.zeros(n)
        ours.grad = g.to(device)
        opt.step()
        exact = BETAS[1] * exact + (1 - BETAS[1]) * (1.0 if t < up else 0.0)
        nearest = (BETAS[1] * nearest.float() + (1 - BETAS[1]) * g * g).bfloat16()
    v = opt.state[ours]["exp_avg_sq"]
    assert v.dtype == torch.bfloat16 and v.device == device
    eps = 0.05 + (up + down) * 4 * U32
    assert abs(v.float().mean().item() / exact - 1) <= eps
    # the rounding-to-nearest control is far outside: the test tells the two apart
    assert nearest.float().mean().item() / exact - 1 > math.pow(BETAS[1], -down) - 1 - eps


def assert_8_bit_second_moment_decays(device: torch.device) -> None:
    """tests/test_adam_stats_8bit.py's decay test (its docstring derives eps) on ``device``:
    a 32 x 4096 parameter whose blocks' first elements get gradient 1 at every step, the others
    +-1 for 50 steps and then 0 for 250; the mean of the decaying elements' 8-bit v within eps
    of float32's, which v rounded to nearest in the same blocks (the control) misses."""
    rows, cols, up, down = 32, 4096, 50, 250
    p, ref = (torch.nn.Parameter(torch.zeros(rows, cols, device=device)) for _ in range(2))
    opt, ref_opt = plugin_adam([p], "8bit"), plugin_adam([ref])
    qmap = dynamic_map(False)
    midpoints = (qmap[1:] + qmap[:-1]) / 2
    nearest = torch.zeros(rows, cols)  # v stored rounded to nearest, in the same blocks
    generator = torch.Generator().manual_seed(0)
    for t in range(up + down):
        g = torch.randint(0, 2, (rows, cols), generator=generator).float() * 2 - 1 \
            if t < up else torch.zeros(rows, cols)
        g[:, ::BLOCK] = 1.0  # each block's first element: its largest
        p.grad, ref.grad = g.to(device), g.to(device)
        opt.step()
        ref_opt.step()
        y = (BETAS[1] * nearest + (1 - BETAS[1]) * g * g).view(rows, -1, BLOCK)
        a = y.amax(-1, keepdim=True)
        nearest = (qmap[torch.bucketize(y / a, midpoints)] * a).view(rows, cols)
    state = opt.state[p]
    assert state["exp_avg_sq"].device == device
    v = dequantize(state["exp_avg_sq"], state[ABSMAX_KEYS["exp_avg_sq"]], False).cpu()
    exact = ref_opt.state[ref]["exp_avg_sq"].cpu()
    decaying = torch.ones(rows, cols, dtype=torch.bool)
    decaying[:, ::BLOCK] = False
    want = exact[decaying].mean().item()
    eps = 5e-4 + (up + down) * 8 * U32
    print(f"mean v: float32 {want:.6f}, 8-bit {v[decaying].mean().item():.6f}, "
          f"rounded to nearest {nearest[decaying].mean().item():.6f}")
    assert abs(v[decaying].mean().item() - want) <= eps
    # the rounding-to-nearest control is far off: the test tells the two apart
    assert nearest[decaying].mean().item() - want > 20 * eps


# -- bf16 weights (--memory-efficient-bf16): the law of the weight update (derived in
# tests/test_bf16_weights.py)

#: the rows of the weight law's parameter: R stores of every input (each row the same inputs,
#: its own draws: the stream's consecutive 16-bit draws are independent and uniform)
LAW_ROWS = 4096
#: the false-failure probability the bands are drawn for
LAW_DELTA = 1e-9


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


def assert_bf16_weight_update_law(device: torch.device, stats: str) -> None:
    """tests/test_bf16_weights.py's law of the bf16 weight update, on ``device``."""
    R, DELTA = LAW_ROWS, LAW_DELTA
    weights, grads = law_inputs()
    m = weights.numel()
    weights, grads = weights.to(device), grads.to(device)
    ours = weights.repeat(R, 1).requires_grad_()
    ours.grad = grads.repeat(R, 1)
    master = weights.float().repeat(R, 1).requires_grad_()
    master.grad = grads.float().repeat(R, 1)
    plugin_adam([ours], stats, lr=1e-4, bf16_weights=True).step()
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


