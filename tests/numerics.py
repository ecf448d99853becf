"""Tolerances for comparing training runs, each derived from the numerics (not from one
machine's results), and the helpers that apply them to fairseq's printed logs.

fairseq prints losses and gradient norms rounded (``round=3`` for both): a printed value is
within half a unit of its last digit of the true value, so two printed values of equal true
values can differ by one unit of the last digit. ``printed_close`` allows that unit on top of
the relative tolerance, which covers the true values' own difference.
"""
from __future__ import annotations

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


def printed_close(a, b, rel: float) -> bool:
    """Printed values a, b (strings as fairseq logs them, or floats) of true values within
    rel x |b| of each other: allow one unit of the coarser last printed digit as well."""
    def unit(x) -> float:
        text = str(x)
        return 10.0 ** -len(text.split(".")[1]) if "." in text and "e" not in text else 0.0
    x, y = float(a), float(b)
    return abs(x - y) <= rel * abs(y) + max(unit(a), unit(b)) * (1 + 1e-9)


def per_update(output: str, keys=("loss", "gnorm")) -> dict[int, tuple[str, ...]]:
    """update number -> the printed values of keys (fairseq's train_inner records)."""
    return {int(r["num_updates"]): tuple(r[k] for k in keys) for r in train_inner(output)}


def assert_runs_close(got: str, want: str, rel: float, updates: int,
                      keys=("loss", "gnorm")) -> None:
    """Two runs' logs: the same updates 1..updates, each printed value within ``rel``."""
    a, b = per_update(got, keys), per_update(want, keys)
    assert sorted(a) == sorted(b) == list(range(1, updates + 1)), (sorted(a), sorted(b))
    worst = max(abs(float(x) - float(y)) / abs(float(y)) for n in a for x, y in zip(a[n], b[n])
                if float(y))
    print(f"largest relative difference of {keys} over {updates} updates: {worst:.2e} "
          f"(tolerance {rel:.2e} + one printed digit)")
    for n in a:
        for key, x, y in zip(keys, a[n], b[n]):
            assert printed_close(x, y, rel), f"update {n} {key}: {x} vs {y} (rel {rel})\n" \
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


def adam_drift_bound(lr: float, updates: int, betas=(0.9, 0.999)) -> float:
    """How far apart two Adam runs can take one parameter element in ``updates`` steps when its
    gradient is rounding noise: a parameter whose exact gradient is zero (a key projection's
    bias: softmax ignores a constant added to every key score) gets a float gradient made of
    rounding errors that depend on reduction order and the CPU's kernels; Adam normalises it to
    lr-sized steps in directions the two runs do not share. Each run moves at most
    lr x adam_step_bound(t) at step t, in opposite directions at worst."""
    return 2 * lr * sum(adam_step_bound(t, betas) for t in range(1, updates + 1))


#: Parameters whose exact gradient is zero in a fairseq transformer: the key projections'
#: biases (adding b to every key adds q.b to every score of a query, which softmax removes).
ZERO_GRADIENT_SUFFIXES = ("k_proj.bias",)


#: Stored-moment rounding (optimizer/adam_stats.py), per store, relative to the value stored:
#: fp16 after fairseq's scaling: the division, fp16's rounding and the multiplication back,
#: U16 + 3 x U32 (fp16's underflow, below 2^-24 of the scale, is an absolute error: see
#: moment_rounding_step_error); bf16 rounded stochastically: less than one unit in the last
#: place, 2^-7 (twice bf16's unit roundoff).
FP16_MOMENT = U16 + 3 * U32
BF16_MOMENT = 2 * U_BF16


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
