"""Tolerances for comparing training runs, each derived from the numerics (not from one
machine's results), and the helpers that apply them to fairseq's printed logs.

How fairseq prints a logged value: the meter rounds it to its ``round=`` decimals
(``safe_round``: loss and nll_loss 3, in the criterion; gnorm 3, in the trainer; ppl 2, in
``utils.get_perplexity``), then the progress bar formats that number with ``"{:g}"``
(``format_stat``): at most 6 significant digits, trailing zeros dropped ("7.1" for 7.100). So a
printed value is within half a unit of the 3rd (or 2nd) decimal of the true value, plus, where
6 significant digits do not reach that decimal (values of 1000 and above at round=3), half a
unit of the 6th significant digit. ``printed_close`` takes that half unit from the key's
``round=`` and the value's size, never from the digits the string happens to show.
"""
from __future__ import annotations

import json
import math

from launcher import train_inner

#: float32 unit roundoff (2^-24; 24-bit significand).
U32 = 2.0 ** -24
#: float16 unit roundoff (2^-11; 11-bit significand).
U16 = 2.0 ** -11
#: bfloat16 unit roundoff (2^-8; 8-bit significand).
U_BF16 = 2.0 ** -8

#: Two float32 runs of the same model on the same data whose sums are associated in another
#: order (a gradient reduced over other ranks or micro-batches, a norm summed shard by shard).
#: A reassociated sum of n terms differs by at most n x U32 of the terms' magnitude: with the
#: few hundred to thousand terms per sum of these tiny runs, <= 1e-4 relative at worst (1e-6
#: typically). Adam divides each gradient element by its own running magnitude, so a relative
#: perturbation of the gradients changes each step by that fraction of an lr-sized step, which
#: changes the next loss by that fraction of what the step changed it by; over the <= 20
#: updates of these runs (lr 1e-3) that stays below the per-sum bound, so 1e-4 relative covers
#: the printed loss and gradient norm. Parameters whose exact gradient is zero move in other
#: ways (``adam_drift_bound``) but change no loss. Measured: 0 at the printed precision
#: against stock DDP over 20 updates.
FP32_REORDERED = 1e-4


#: fairseq's ``round=`` for the logged values the tests compare (see the module docstring);
#: ``train_``/``valid_`` prefixes (epoch summaries) name the same meters.
PRINTED_ROUND = {"loss": 3, "nll_loss": 3, "gnorm": 3, "ppl": 2}
#: ``"{:g}"``'s significant digits
G_DIGITS = 6


def printed_round(key: str) -> int:
    """The ``round=`` of a logged key (KeyError for one whose rounding is not listed)."""
    for prefix in ("train_", "valid_"):
        key = key.removeprefix(prefix)
    return PRINTED_ROUND[key]


def printed_half_unit(printed, key: str) -> float:
    """The largest |printed - true| of a value fairseq printed under ``key``: half a unit of its
    ``round=`` decimal, plus half a unit of the 6th significant digit where ``"{:g}"`` rounds
    the rounded value again (its exponent read from the printed value: at a carry, 999999.5 ->
    1e+06, that is the larger of the two, so still a bound)."""
    value = abs(float(printed))
    decimals = printed_round(key)
    half = 0.5 * 10.0 ** -decimals
    if value > 0:
        exponent = math.floor(math.log10(value))
        if exponent - (G_DIGITS - 1) > -decimals:  # 6 digits stop above the round= decimal
            half += 0.5 * 10.0 ** (exponent - (G_DIGITS - 1))
    return half


def printed_close(a, b, rel: float, key: str) -> bool:
    """Printed values a, b of ``key`` (strings as fairseq logs them, or their floats) whose
    true values x_a, x_b satisfy |x_a - x_b| <= rel x |x_b|: then |a - b| <= h_a + h_b +
    rel x (|b| + h_b), h being each printed value's half unit (``printed_half_unit``). The last
    term bounds |x_b| from the printed b; 1e-12 relative absorbs reading decimal strings into
    binary floats."""
    x, y = float(a), float(b)
    ha, hb = printed_half_unit(a, key), printed_half_unit(b, key)
    allowed = ha + hb + rel * (abs(y) + hb)
    return abs(x - y) <= allowed + 1e-12 * max(abs(x), abs(y))


def per_update(output: str, keys=("loss", "gnorm")) -> dict[int, tuple[str, ...]]:
    """update number -> the printed values of keys (fairseq's train_inner records)."""
    return {int(r["num_updates"]): tuple(r[k] for k in keys) for r in train_inner(output)}


def first_updates(output: str, last: int) -> str:
    """``output`` without its train_inner records after update ``last``: what a shorter run
    with the same flags logged (no schedule that depends on the run's length)."""
    return "\n".join(line for line in output.splitlines() if "| train_inner | " not in line or
                     int(json.loads(line.split("| train_inner | ", 1)[1])["num_updates"]) <= last)


def assert_runs_close(got: str, want: str, rel: float, updates: int,
                      keys=("loss", "gnorm")) -> None:
    """Two runs' logs: the same updates 1..updates, each printed value within ``rel``."""
    a, b = per_update(got, keys), per_update(want, keys)
    assert sorted(a) == sorted(b) == list(range(1, updates + 1)), (sorted(a), sorted(b))
    worst = max(abs(float(x) - float(y)) / abs(float(y)) for n in a for x, y in zip(a[n], b[n])
                if float(y))
    print(f"largest relative difference of {keys} over {updates} updates: {worst:.2e} "
          f"(tolerance {rel:.2e} + the printed rounding)")
    for n in a:
        for key, x, y in zip(keys, a[n], b[n]):
            assert printed_close(x, y, rel, key), f"update {n} {key}: {x} vs {y} (rel {rel})\n" \
                                                  f"{a}\n{b}"


def adam_step_bound(step: int, betas=(0.9, 0.999)) -> float:
    """The largest |update| / lr that (bias-corrected) Adam can make at ``step`` (1-based),
    whatever the gradients: by Cauchy-Schwarz, |m_t| <= (1 - b1) / sqrt(1 - b2) x
    sqrt(sum_j<t (b1^2 / b2)^j) x sqrt(v_t), times the bias correction
    sqrt(1 - b2^t) / (1 - b1^t). (1.0 at step 1: Adam's first step is lr x sign(g).)"""
    b1, b2 = betas
    r = b1 * b1 / b2
    series = sum(r ** j for j in range(step))
    return (1 - b1) / math.sqrt(1 - b2) * math.sqrt(series) * \
        math.sqrt(1 - b2 ** step) / (1 - b1 ** step)


#: Stored-moment rounding (optimizer/adam_stats.py), per store, relative to the value stored:
#: fp16 after fairseq's scaling: the division, fp16's rounding and the multiplication back,
#: U16 + 3 x U32 (fp16's underflow, below 2^-24 of the scale, is an absolute error: see
#: moment_rounding_step_error); bf16 rounded stochastically: less than one unit in the last
#: place, 2^-7 (twice bf16's unit roundoff).
FP16_MOMENT = U16 + 3 * U32
BF16_MOMENT = 2 * U_BF16
#: 8-bit moments (optimizer/moments/blockwise_8bit.py), per store, relative to the largest element of
#: the value's block (not to the value): the largest gap of the dynamic map, where a
#: stochastically rounded code may land, 0.9 / 64 for the signed map (the first moment) and
#: 0.9 / 128 for the unsigned one, up to the float32 rounding of the map's values (a few U32:
#: tests/test_adam_stats_8bit.py checks the maps). Plus 2 x U32 for the division by the
#: block's largest and the multiplication back.
EIGHT_BIT_SIGNED_GAP = 0.9 / 64 + 4 * U32
EIGHT_BIT_UNSIGNED_GAP = 0.9 / 128 + 4 * U32


def moment_rounding_step_error(u: float, step: int, betas=(0.9, 0.999)) -> float:
    """How far (in units of lr) Adam's step ``step`` (1-based) can move one parameter element
    away from the step float32 moments give, when each moment was rounded to relative ``u``
    after every earlier step. To first order in u:

    - the second moment: rounding errors made at steps k < t reach v_t multiplied by
      b2^(t-k), and b2^(t-k) v_k <= v_t (v only adds non-negative terms), so v_t is off by at
      most (t - 1) u relative, sqrt(v_t) by (t - 1) u / 2, and the step, which is at most
      adam_step_bound(t) x lr, by that fraction of it;
    - the first moment: an error u |m_k| made at step k reaches m_t multiplied by b1^(t-k);
      by Cauchy-Schwarz |m_k| <= (1 - b1) / sqrt(1 - b2) x sqrt(sum_j (b1^2/b2)^j) x sqrt(v_k)
      and sqrt(v_k) <= b2^-(t-k)/2 sqrt(v_t), so the error is at most u x that factor x
      sum_{j>=1} (b1 / sqrt(b2))^j x sqrt(v_t), i.e. the step moves by that times the bias
      correction sqrt(1 - b2^t) / (1 - b1^t) over sqrt(v_t).

    The first step uses no stored moment: 0. Elements whose scaled fp16 second moment
    underflows to 0 (gradients below about 1e-6 of their tensor's largest) step by m / eps
    instead; their gradients, that small, change the loss by that little."""
    b1, b2 = betas
    r = b1 * b1 / b2
    cauchy = (1 - b1) / math.sqrt(1 - b2) * math.sqrt(sum(r ** j for j in range(step)))
    carried = sum((b1 / math.sqrt(b2)) ** j for j in range(1, step))
    first = u * cauchy * carried * math.sqrt(1 - b2 ** step) / (1 - b1 ** step)
    second = (step - 1) * u / 2 * adam_step_bound(step, betas)
    return first + second


#: Plain SGD (no momentum): the two runs' updates are lr x their clipped gradients, with no
#: per-element normalisation, so an element whose gradient is rounding noise (a ReLU unit whose
#: gradient cancels, a key projection's bias) moves by lr x that noise in both runs, not by an
#: lr-sized step as under Adam. The comparisons of weights across backends therefore train with
#: SGD: what separates the runs is bounded by their gradients' rounding, on any CPU.
#:
#: How far the weights may then go apart (``sgd_reordered_bound``), per update t of T:
#: - the gradients' sums are associated in another order (FP32_REORDERED relative to the terms'
#:   magnitude, bounded by the update's clipped gradient 2-norm s_t = min(gnorm_t, clip), which
#:   bounds every element of the clipped gradient), and the clipping coefficient clip / gnorm is
#:   computed from a norm summed in another order (FP32_REORDERED relative again, of an element at
#:   most s_t): the steps differ by at most 2 x FP32_REORDERED x lr x s_t;
#: - each run rounds w - lr x g to float32: U32 x |w| each, |w| at most the final |w| plus the
#:   steps still to come (lr x the sum of s);
#: - the runs' weights differ, so their next gradients differ by the Hessian times that
#:   difference: with L the largest curvature along the way, each update multiplies the
#:   difference by at most (1 + lr x L), e^(lr x L x T) over the run. SGD_CURVATURE bounds L for
#:   conftest's tiny model (a property of the model and data, not of a CPU).
#: A wrong gradient (a missed term, a wrong scale of part of a tensor) moves its elements by
#: lr x T x its size, orders of magnitude above, wherever the gradient is not tiny.
#:
#: SGD_CURVATURE: the tiny model's largest Hessian eigenvalue in magnitude at its seed-1
#: initialisation, on 4 of the test corpus's batches of 200 tokens (the loss per token, as
#: fairseq divides it), by power iteration on Hessian-vector products: -8.21 (float32 and
#: float64 alike to 3 digits, 2026-12-04; a property of the model and data, which a CPU changes
#: only by rounding); 100 is the bound used (e^(1e-3 x 100 x 10) = 2.7 for 10 updates at lr
#: 1e-3). 10 SGD updates at lr 1e-3 move no weight far enough to raise it 12-fold.
SGD_CURVATURE = 100.0


def sgd_reordered_bound(lr: float, step_norms, weights):
    """Elementwise bound on |w_a - w_b| after len(step_norms) plain-SGD updates of two float32
    runs from the same weights on the same batches whose sums are associated in other orders
    (comment above). ``step_norms``: each update's clipped gradient norm min(gnorm, clip) (an
    upper bound of it: a printed gnorm plus its half unit); ``weights``: one run's final weights
    (a tensor)."""
    steps = len(step_norms)
    moved = lr * sum(step_norms)
    growth = math.exp(lr * SGD_CURVATURE * steps)
    return growth * (2 * FP32_REORDERED * moved + 2 * steps * U32 * (weights.abs() + moved))


def clipped_norms(printed_gnorms, clip: float) -> list[float]:
    """Upper bounds of each update's clipped gradient norm, min(gnorm, clip), from the gnorm
    fairseq printed (the norm before clipping) plus its half unit."""
    return [min(float(g) + printed_half_unit(g, "gnorm"), clip) for g in printed_gnorms]


#: Runs whose difference from a reference has no bound that can be derived (stochastic
#: rounding of Adam's stored moments: an element's error is relative to its block's largest, or
#: it is carried through many steps of a run whose weights already differ) are compared with the
#: spread of the noise itself: the same run with other rounding draws (tests/probes/
#: other_rounding_draws.py: the same model, batches and dropout, other random numbers). A
#: systematic error (a wrong scale, a wrong block, a code read as its neighbour) moves the run
#: and its twin alike away from the reference, leaving the twin's spread at the noise.
#:
#: The tolerance of each update n: NOISE_FACTOR x the largest spread |run - twin| among the
#: updates within NOISE_REACH of n (K <= 2 x NOISE_REACH + 1 of them), each at the upper end of
#: what the printed values allow (plus both half units), plus the printed rounding. Why local:
#: the runs drift apart as they go (the noise's effect on the weights adds up step by step), so
#: the largest spread of a long window is that of its end, and an early update would be allowed
#: a multiple of the divergence reached much later; the neighbourhood's is that of its own time
#: (at most NOISE_REACH updates later). Why a neighbourhood and not update n's spread alone: a
#: printed difference is the weights' difference seen through that update's batch, so from one
#: update to the next it changes sign and size while its scale sigma_n (that of the weights'
#: difference) barely moves; one update's spread can be near zero by chance, K of them hardly.
#: How large: the run and the reference differ by one draw of the noise D_n (scale sigma_n);
#: the run and its twin by two independent draws, S_m (scale sqrt(2) sigma_m). Modelled as
#: Gaussian and independent from update to update, P(|D_n| > F max_K |S_m|) at F = 5 is
#: 2.2e-7 for K = 10 (a comparison of 10 updates), 7.6e-8 for K = 11 (the first and last
#: updates of a longer one) and 9.2e-12 for K = 21 (integrated numerically; the S_m of update n
#: itself shares D_n's draw, which only lowers it): over the 2 x 198 values of 200 updates at
#: most 3e-5 even if every update had only 11 neighbours. F = 3 would give 1.1e-5 per value at
#: K = 11 (4e-3 over 396): hence 5.
NOISE_FACTOR = 5.0
NOISE_REACH = 10


def spread(a: dict, b: dict, updates, index: int, key: str) -> float:
    """The largest relative |x_a - x_b| of two runs' printed value ``index`` (per_update's)
    over ``updates``, each difference at its upper end given the printed rounding (plus both
    half units), relative to b's value."""
    return max((abs(float(a[n][index]) - float(b[n][index])) +
                printed_half_unit(a[n][index], key) + printed_half_unit(b[n][index], key))
               / abs(float(b[n][index])) for n in updates)


def assert_within_noise(got: str, want: str, twin: str, updates, keys=("loss", "gnorm"),
                        noisy: str | None = None) -> None:
    """Run ``got`` against ``want`` (the reference) at each of ``updates``: each printed value
    within NOISE_FACTOR x the spread between ``got`` and ``twin`` (the same run with other
    rounding draws) around that update (within NOISE_REACH of it, among ``updates``), plus the
    printed rounding (the comment above). ``noisy``: the run whose spread with ``twin`` is the
    noise, when ``got`` is a control held to another run's noise (default: ``got``)."""
    a, b, c = (per_update(out, keys) for out in (got, want, twin))
    noise_run = a if noisy is None else per_update(noisy, keys)
    updates = list(updates)
    for index, key in enumerate(keys):
        ratios = []
        for n in updates:
            near = [m for m in updates if abs(m - n) <= NOISE_REACH]
            noise = spread(noise_run, c, near, index, key)
            assert printed_close(a[n][index], b[n][index], NOISE_FACTOR * noise, key), \
                f"update {n} {key}: {a[n]} vs {b[n]}, beyond {NOISE_FACTOR} x the " \
                f"spread {noise:.2e} of other rounding draws around it ({c[n]})"
            difference = abs(float(a[n][index]) - float(b[n][index])) / abs(float(b[n][index]))
            ratios.append((difference / noise, n, difference, noise))
        ratio, n, difference, noise = max(ratios)
        print(f"updates {updates[0]}-{updates[-1]} {key}: the largest relative difference "
              f"over the spread around it: {ratio:.2f} at update {n} ({difference:.2e} / "
              f"{noise:.2e})")
