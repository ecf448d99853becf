"""Gradient shards kept in the 16-bit reduce dtype (sharding/sixteen_bit_grads.py) and the step that
takes them (optimizer/row_chunk_step.py): fairseq-train with ``--fsdp2-reduce-dtype bf16/fp16``
against the same run with ``--fsdp2-fp32-grad-shards`` (FSDP2's default: the 16-bit
reduce-scatter output cast to an fp32 shard), 2 ranks.

Why bit for bit: FSDP2 reduce-scatters in the reduce dtype either way, and its fp32 shard is
that 16-bit value widened, exactly. Everything fairseq then does to the gradient is done to
the same values in the same float32 operations: ``multiply_grads`` (fairseq's 1 / sample size,
the fp16 wrapper's unscaling) and the clipping factor are applied to each widened chunk in the
order they were asked for, as float32 products (what scaling the fp32 shard in place computes);
the norm is taken over the same row chunks of the same float32 values (grad_norm.local_norm);
Adam steps the same float32 numbers. So the logged loss, gradient norm and loss scale of every
update agree exactly, overflows and skipped updates included (fp16 from a loss scale of
OVERFLOW_SCALE: the fp16 gradients overflow, inf in 16 bits is inf widened).

Equal runs alone would not show that the 16-bit path was taken (a trainer that quietly kept
fp32 shards would equal the reference too): every run goes through tests/probes/step_dtypes.py,
which records, on each rank at the start of each optimizer step, the dtype of every gradient
the step takes and of every reduce-scatter input.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, STEP_DTYPES, steps_seen, train_args_for
from launcher import ok, run_ranks, train_inner
from numerics import per_update
from scenarios import FSDP2

WIDE = ["--fsdp2-fp32-grad-shards"]
KEPT = "gradient shards kept in the reduce dtype"
#: 3 updates: the first steps from no stored moment, the next two from stored ones, as every
#: later update would (the 16-bit shards, their pending factors and the clipping are applied
#: anew at every update; tried by hand: a 16-bit gradient's pending factors applied in reverse
#: order print the same values, and the weights after update 3 differ: red)
UPDATES = 3
#: fp16's initial loss scale, one that overflows: the tiny model's fp16 gradients fit from a
#: scale of 2^8 here (from 2^26, 17 overflows, each a whole forward and backward skipped); from
#: 2^14, 6 overflows (2^14 .. 2^9). The tests ask for at least 3: the largest gradient would
#: have to grow by a factor 16, where another CPU's rounding moves it by a fraction of a percent
#: (test_backend's fp32-reduced fp16 run fits from 2^9)
OVERFLOW_SCALE = 2 ** 14
#: bf16 compute and reduction with 8-bit moments (the 600M benchmark's flags), and fp16 with
#: float32 moments under fairseq's loss scaling, starting at a scale that overflows
CASES = {"bf16_8bit": ["--bf16", "--fsdp2-reduce-dtype", "bf16", "--eight-bit-adam-stats"],
         "fp16_overflow": ["--fp16", "--fsdp2-reduce-dtype", "fp16", "--fp16-init-scale",
                           str(OVERFLOW_SCALE)]}


def train(corpus, save_dir, *flags) -> tuple[list, dict]:
    """Every rank's result (each exited 0; their output shows what their optimizer steps
    took: conftest.steps_seen) and the final weights: the consolidated checkpoint the run
    itself wrote at the end of training (checkpoint_last_consolidated.pt, what
    ``python -m fairseq_fsdp2.consolidate`` exports from checkpoint_last.pt)."""
    results = run_ranks(2, lambda r: train_args_for(corpus, save_dir, *FSDP2, *flags,
                                                    updates=UPDATES, save=True), **STEP_DTYPES)
    ok(results)
    exported = save_dir / "checkpoint_last_consolidated.pt"
    return results, torch.load(exported, weights_only=True)["model"]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """train(*flags), each command line run once in this module: the narrow fp16 run of
    test_16_bit_gradient_shards_train_bit_identical_to_fp32_shards also serves
    test_fp16_reduction_overflow_is_seen_and_skipped_on_every_rank."""
    done = {}

    def run(*flags):
        if flags not in done:
            done[flags] = train(corpus, tmp_path_factory.mktemp("run"), *flags)
        return done[flags]
    return run


def assert_steps_took(steps: list, grads: str, reduced: str, count: int) -> None:
    """On every rank, ``count`` optimizer steps, each taking sharded gradients (DTensors) of
    dtype ``grads`` only, as many at every step and rank (every parameter's), after
    reductions in dtype ``reduced`` only."""
    assert [len(rank) for rank in steps] == [count] * len(steps), steps
    records = [s for rank in steps for s in rank]
    assert {tuple(s["grads"]) for s in records} == {(f"DTensor {grads}",)}, records
    assert len({s["grads"][f"DTensor {grads}"] for s in records}) == 1, records
    assert {dtype for s in records for dtype in s["reduced"]} == {reduced}, records


def reduce_dtype(flags) -> str:
    """The torch dtype --fsdp2-reduce-dtype names, as the probe prints it."""
    return {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[
        flags[flags.index("--fsdp2-reduce-dtype") + 1]]


@pytest.mark.parametrize("case", list(CASES))
def test_16_bit_gradient_shards_train_bit_identical_to_fp32_shards(case, trained):
    flags = CASES[case]
    narrow_results, weights = trained(*flags)
    wide_results, wide_weights = trained(*flags, *WIDE)
    narrow, narrow_steps = narrow_results[0].output, steps_seen(narrow_results)
    wide, wide_steps = wide_results[0].output, steps_seen(wide_results)
    # the two paths under comparison were taken: both reduce-scatter in the reduce dtype; the
    # narrow run's every step takes the 16-bit shards, the reference's the fp32 ones
    # (overflowed updates take no step: the UPDATES counted ones do)
    assert_steps_took(narrow_steps, reduce_dtype(flags), reduce_dtype(flags), UPDATES)
    assert_steps_took(wide_steps, "torch.float32", reduce_dtype(flags), UPDATES)
    assert KEPT in narrow and KEPT not in wide
    keys = ("loss", "gnorm", "loss_scale") if "--fp16" in flags else ("loss", "gnorm")
    got, want = per_update(narrow, keys), per_update(wide, keys)
    assert sorted(want) == list(range(1, UPDATES + 1)), want
    assert got == want
    # the weights after the last update, bit for bit (the printed values are rounded)
    assert weights.keys() == wide_weights.keys()
    differ = [k for k in weights if not torch.equal(weights[k], wide_weights[k])]
    assert not differ, differ
    if case == "fp16_overflow":  # the overflow path was exercised, alike
        note = "gradient overflow detected"
        assert narrow.count(note) >= 3 and narrow.count(note) == wide.count(note)


def test_fsdp2_keeps_the_reduce_dtype_gradient_shards():
    """FSDP2's private state that sharding/sixteen_bit_grads.py sets (FSDPParamGroup._orig_dtype,
    torch 2.13) still does what it did: two small models sharded alike on 2 ranks, bf16
    reduce-scatter, over two forward/backward passes (FSDP2's lazy initialization in
    between): the kept gradients are bf16 DTensors laid out like their parameters, equal to
    FSDP2's default fp32 shards, which are fp32. A torch that renames or ignores it fails
    here (AttributeError in the probe, or fp32 gradients), not silently."""
    out = ok(run_ranks(2, lambda r: [], module="narrow_grads_probe",
                       env={"PYTHONPATH": str(REPO / "tests" / "probes")}))
    r = json.loads(next(line for line in out.splitlines() if line.startswith("PROBE "))[6:])
    assert r["groups"] == 2  # the two layers' units (the root holds no parameter)
    assert r["dtypes"] == ["torch.bfloat16"] * 8, r["dtypes"]
    assert r["wide_dtypes"] == ["torch.float32"] * 8, r["wide_dtypes"]
    assert all(r["dtensor"]) and all(r["equal"]), r


def test_gradients_accumulated_over_micro_batches_stay_fp32(corpus, tmp_path):
    """--update-freq 2: FSDP2 adds each micro-batch's reduced gradient to the shard, which in
    16 bits would round every sum; the trainer keeps FSDP2's fp32 shards then (and trains):
    the steps take fp32 shards, reduced in bf16 (tests/probes/step_dtypes.py)."""
    flags = CASES["bf16_8bit"]
    results = run_ranks(2, lambda r: train_args_for(
        corpus, tmp_path, *FSDP2, *flags, "--update-freq", "2", updates=2), **STEP_DTYPES)
    out = ok(results)
    assert KEPT not in out and sorted(per_update(out)) == [1, 2]
    assert_steps_took(steps_seen(results), "torch.float32", reduce_dtype(flags), 2)


def test_fp16_reduction_overflow_is_seen_and_skipped_on_every_rank(trained):
    """--fsdp2-reduce-dtype fp16 under fairseq's loss scaling: an initial scale of
    OVERFLOW_SCALE makes the fp16 gradients overflow (to inf, or NaN where inf - inf); the fp16 reduce-scatter carries
    the non-finite values into the shards (inf / 2 and inf + x stay inf), the global gradient
    norm (all-reduced) is non-finite on every rank, and every rank logs fairseq's overflow note
    and skips the step: the scale halves on both alike until the gradients fit, then training
    goes on. (Each rank's log: tests/probes/step_dtypes.py keeps fairseq's trainer at INFO on
    rank 1 too.) The narrow run of the fp16_overflow case above."""
    results, _ = trained(*CASES["fp16_overflow"])
    note = "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: "
    scales = [[float(line.split(note, 1)[1].split()[0]) for line in r.output.splitlines()
               if note in line] for r in results]
    assert len(scales[0]) >= 3 and scales[0] == scales[1], scales  # the same skips, alike
    assert scales[0] == [OVERFLOW_SCALE / 2.0 ** (i + 1) for i in range(len(scales[0]))], scales
    records = train_inner(results[0].output)
    # skips not counted
    assert [int(r["num_updates"]) for r in records] == list(range(1, UPDATES + 1))
    assert float(records[-1]["loss_scale"]) <= scales[0][-1]
