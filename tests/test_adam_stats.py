"""Adam's moments in 16 bits between steps (optimizer/adam_stats.py): ``--fp16-adam-stats``
(fairseq's scaling) and ``--bf16-adam-stats`` (stochastic rounding).

The moments themselves, in one process: the plugin's Adam and a float32 Adam fed the same
gradients, the 16-bit moments within a bound computed element by element from the rounding of
each store (fairseq-train runs against the float32 moments, and resume: tests/test_backend.py;
the local-shard path against DTensor dispatch: tests/test_local_shards.py). And the checkpoint:
saved at 2 ranks, loaded at 3 (tests/probes/adam_stats_probe.py); the stochastic rounding's
random streams that the 2 ranks' steps drew from, one of their own each.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO
from launcher import ok, run_ranks
from moment_bounds import (BETAS, assert_16_bit_moments_within_bound,
                           assert_bf16_second_moment_decays, effective, plugin_adam)
from numerics import BF16_MOMENT, EIGHT_BIT_SIGNED_GAP, FP16_MOMENT, U32

from fairseq_fsdp2.optimizer.moments.blockwise_8bit import quantizable

PROBES = str(REPO / "tests" / "probes")


def adam(params, stats: str, lr: float = 1e-3):
    return plugin_adam(params, stats, lr, BETAS)


@pytest.mark.parametrize("stats", ["fp16", "bf16"])
def test_16_bit_moments_stay_within_their_rounding_of_float32_moments(stats):
    """30 steps of gradients whose magnitudes span 1e-3..1 (moments over 6 decades), every
    element of both moments after every step within a bound computed from the values
    (moment_bounds.py: a rigorous bound, not a tolerance: any slip in the scale or the rounding
    exceeds it; tests/test_cuda_step.py runs the same comparison on a GPU)."""
    assert_16_bit_moments_within_bound(torch.device("cpu"), stats, {"w": (64, 16)},
                                       FP16_MOMENT if stats == "fp16" else BF16_MOMENT)


def test_fp16_scale_is_fairseqs():
    """fairseq's FusedAdamV1: scale = 1e-8 + max|moment| / 65504; the largest element is
    stored near fp16's largest finite value (65504 / (1 + 1e-8 x 65504 / max))."""
    p = torch.nn.Parameter(torch.zeros(5, 3))
    opt = adam([p], "fp16")
    p.grad = torch.arange(15.0).reshape(5, 3) - 7
    opt.step()
    state = opt.state[p]
    m = (1 - BETAS[0]) * p.grad
    scale = float(state["exp_avg_scale"])
    assert scale == pytest.approx(1e-8 + 0.7 / 65504, rel=U32 * 4)
    assert state["exp_avg"].abs().max().item() == pytest.approx(0.7 / scale, rel=FP16_MOMENT)
    assert 65000 < 0.7 / scale < 65504
    assert torch.allclose(effective(state, "exp_avg"), m, rtol=FP16_MOMENT, atol=0)


def test_bf16_second_moment_decays_as_in_float32():
    """Why stochastic rounding (stochastic_round.py): 50 steps of gradients +-1, then 250 of
    zero gradients, over 4096 elements. The exact v decays by 0.999^250 = 0.78 in the second
    part; bf16 rounded to nearest keeps it (each 0.1% decay is below half a unit in bf16's last
    place), 28% too large. The plugin's bf16 moments, rounded up with probability equal to the
    fraction cut off, are unbiased: each store's error has mean zero and magnitude below
    2 x 2^-8 of the value (1 ulp, and values stay within 2x of the exact ones), and reaches
    v_T multiplied by b2^(T-t) <= v_T / v_t. The mean over N elements of v / v_exact - 1 is a
    sum of N x T such independent increments of at most 2^-6 / N: by Azuma-Hoeffding it exceeds
    eps with probability at most 2 exp(-eps^2 N / (2 T 2^-12)): for eps = 0.05, N = 4096,
    T = 300, 2 x e^-70 (the seed is fixed: deterministic all the same). The float32 arithmetic
    of each step: below 300 x 4 x U32 = 7e-5. tests/test_cuda_step.py runs the same on a GPU
    (another generator: the argument holds for any whose draws are uniform and independent)."""
    assert_bf16_second_moment_decays(torch.device("cpu"))  # moment_bounds.py


def probe_report(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("PROBE "))[6:])


@pytest.fixture(scope="module")
def probe_runs(tmp_path_factory):
    """tests/probes/adam_stats_probe.py: (what its 2 ranks' save reported, what its 3 ranks'
    load reported)."""
    root = tmp_path_factory.mktemp("adam_stats")
    env = {"PYTHONPATH": PROBES}
    saved = ok(run_ranks(2, lambda r: ["save", root], module="adam_stats_probe", env=env))
    loaded = ok(run_ranks(3, lambda r: ["load", root], module="adam_stats_probe", env=env))
    return probe_report(saved), probe_report(loaded)


@pytest.fixture(scope="module")
def resharded(probe_runs):
    return probe_runs[1]


@pytest.mark.parametrize("stats", ["bf16", "8bit"])
def test_every_parameter_moment_rank_and_step_draws_its_own_stream(probe_runs, stats):
    """The stochastic rounding's random streams, as the optimizer made them in the probe's
    2-rank sharded run (3 steps): one per rank, step, rounded parameter (bf16: every one; 8
    bits: those of quantizable shape, the others keep float32 moments) and moment, and no two
    alike, neither their seeds nor their first draws. Were two to share a stream, their
    rounding errors would be one error (correlated between the moments, the parameters or the
    ranks that hold one tensor's shards), not independent ones; the comparisons with float32
    moments measure the noise with the same code, so they could not tell (numerics.py).
    Whether a stream reproduces where it should: the resumes (tests/test_adam_stats_8bit.py,
    tests/test_backend.py) and the chunked step against the whole tensor's draws
    (tests/test_row_chunk_step.py). fp32 and fp16 moments draw nothing."""
    report = probe_runs[0]
    for plain in ("fp32", "fp16"):
        assert report[plain]["streams"] == [[], []]
    ranks, steps = report[stats]["streams"], report[stats]["steps"]
    shapes = report[stats]["shapes"].values()
    rounded = len(shapes) if stats == "bf16" else sum(quantizable(s) for s in shapes)
    assert len(ranks) == 2 and rounded >= 2
    streams = [stream for rank in ranks for stream in rank]
    for rank in ranks:
        assert len(rank) == steps * rounded * 2, (len(rank), steps, rounded)
    assert len({seed for seed, _ in streams}) == len(streams)
    assert len({tuple(first) for _, first in streams}) == len(streams)


F32, F16, BF16, U8 = "torch.float32", "torch.float16", "torch.bfloat16", "torch.uint8"
#: (saved, run) -> the moments' dtypes as loaded, and after the next step (8 bits: the
#: weights' codes; the biases, under 4096 elements, keep float32)
DTYPES = {"fp16->fp16": ([F16], [F16]),
          "bf16->bf16": ([BF16], [BF16]),
          "fp16->fp32": ([F16], [F32]),
          "fp32->fp16": ([F32], [F16]),
          "bf16->fp16": ([BF16], [F16]),
          "8bit->8bit": ([F32, U8], [F32, U8]),
          "8bit->fp32": ([F32, U8], [F32]),
          "fp32->8bit": ([F32], [F32, U8]),
          "fp16->8bit": ([F16], [F32, U8])}


@pytest.mark.parametrize("pair", list(DTYPES))
def test_16_and_8_bit_state_reshards_and_converts_between_formats(resharded, pair):
    """Saved by 2 ranks in the plugin's sharded checkpoint, loaded by 3 (other, uneven shards;
    8 bits: blocks of 256 and 44 in the 300-element rows, one block in the 20-element rows):
    the state is what was saved, bit for bit, in its saved dtype (16-bit moments are not
    widened to float32 by loading, 8-bit codes not cast: no float32 copy of the state at
    resume); and with or without the flag, the next step computes from the saved values and
    stores the run's own format."""
    r = resharded[pair]
    run = pair.split("->")[1]
    assert r["bits_equal"]
    assert r["loaded_dtypes"] == DTYPES[pair][0]
    assert r["after_dtypes"] == DTYPES[pair][1] and r["after_is_dtensor"]
    scales = {"exp_avg_scale", "exp_avg_sq_scale"}
    assert scales <= set(r["after_keys"]) if run == "fp16" else not scales & set(r["after_keys"])
    absmax = {"exp_avg_absmax", "exp_avg_sq_absmax"}
    assert absmax <= set(r["after_keys"]) if run == "8bit" else not absmax & set(r["after_keys"])
    # the zero-gradient step: m x 0.9 and v x 0.999 of the saved values, exact in float32,
    # then one store in the run's format (relative to each tensor's largest element: fp16's
    # rounding, plus its underflow floor of 2^-25 x scale = 2^-25 x (1e-8 / max + 1 / 65504);
    # 8 bits: the map's largest gap plus 2 U32 of the block's largest, at most the tensor's:
    # tests/test_adam_stats_8bit.py)
    floor = 2.0 ** -25 * (1e-8 / r["min_peak"] + 1 / 65504) * (1 + 4 * U32)
    allowed = {"fp32": 0.0, "fp16": FP16_MOMENT + floor, "bf16": BF16_MOMENT,
               "8bit": EIGHT_BIT_SIGNED_GAP + 2 * U32}[run]
    assert r["min_peak"] > 0 and r["after_max_rel"] <= allowed
