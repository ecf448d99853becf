"""FSDP2's collectives on gloo (fairseq_fsdp2/sharding/gloo_collectives.py): the same values as gloo's own,
without their full-size temporaries, and used by FSDP2 (tests/probes/gloo_comms_probe.py, real
gloo ranks forked from the test server)."""
import json

import pytest

from conftest import REPO
from launcher import ok, run_ranks


PROBES = str(REPO / "tests" / "probes")


@pytest.fixture(scope="module")
def reports():
    """One 4-rank probe run: its checks on the 4 ranks, then on a 2-rank group of two of them
    (a gloo context of 2, as a 2-process world's; the probe's docstring)."""
    out = ok(run_ranks(4, lambda r: [], module="gloo_comms_probe", env={"PYTHONPATH": PROBES}))
    return json.loads(next(line for line in out.splitlines() if line.startswith("PROBE "))[6:])


@pytest.fixture(scope="module", params=[2, 4])
def report(request, reports):
    assert reports[str(request.param)]["world_size"] == request.param
    return reports[str(request.param)]


@pytest.mark.parametrize("case", ["collectives", "uneven"])
def test_same_values_as_gloos_own_collectives(report, case):
    r = report[case]
    assert r["all_gather_equal"]  # broadcasting copies bits
    if report["world_size"] == 2:  # a + b = b + a: the same bits
        assert r["reduce_scatter_max_diff"] == 0.0, r
    # n terms, associated otherwise: each result within gamma(n - 1) x the sum of the terms'
    # magnitudes of the exact sum, so within twice that of each other (the probe's
    # ``collectives`` gives each element's difference in those units)
    assert r["reduce_scatter_diff_in_gamma_sums"] <= 2.0, r


def test_no_full_size_temporaries(report):
    """gloo's own all-gather holds a temporary as large as its output, its reduce-scatter one
    as large as its input (if torch changes that, this fails and gloo_collectives.py can go); ours
    hold none that grows with the data. gloo's all-reduce keeps scratch buffers of a fixed size
    (not bounded here), so what is compared is the resident memory added at 8 MiB shards minus
    that at 2 MiB shards: a fixed scratch cancels, while a temporary as large as even one shard
    adds at least the 6 MiB difference, and gloo's (world x shard) at least world x 6 MiB. Half
    of 6 MiB separates the two whatever the fixed part is, as long as it varies by less than
    that between two calls. Between these two sizes it does not vary: gloo's ring all-reduce
    (inside our reduce-scatter; gloo/allreduce.cc) keeps two segments of min(input / (2 x
    world), 1 MiB) bytes, and our input is world x shard, so from 2 MiB shards up its scratch
    is the same 2 x 1 MiB (smaller shards would shrink it: the reason for 2 MiB)."""
    big, small = report["collectives"], report["quarter"]
    size = report["world_size"]
    grown = big["bytes"] - small["bytes"]  # 6 MiB of shard
    for name in ("all_gather", "reduce_scatter"):
        (ours_big, theirs_big), (ours_small, theirs_small) = big["extra"][name], small["extra"][name]
        assert theirs_big - theirs_small >= grown * size - grown / 2, (name, big, small)
        assert ours_big - ours_small < grown / 2, (name, big["extra"], small["extra"])


def test_fsdp2_calls_them_and_trains_as_with_its_own(report):
    # 3 units x 3 steps: an all-gather per unit in forward; in backward the root's parameters
    # stay gathered (PyTorch's default for the root), the layers' are gathered again
    all_gathers, reduce_scatters = report["calls"]
    assert all_gathers == 3 * (3 + 2) and reduce_scatters == 3 * 3, report["calls"]
    assert report["train_moved"] > 1e-3  # 3 Adam steps at lr 1e-2 moved every tensor
    # at most two non-zero terms per gradient sum at any world size (the probe's docstring):
    # the same bits
    assert report["train_max_diff"] == 0.0, report["train_max_diff"]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_16_bit_reduction_through_them_as_through_fsdp2s_own(report, dtype):
    """--fsdp2-reduce-dtype fp16/bf16: FSDP2 hands the installed reduce-scatter a 16-bit input
    (fp16: pre-divided, ReduceOp.SUM, post-divided; bf16: ReduceOp.AVG), which gloo's all-reduce
    sums in that dtype; training through them gives the same bits as through FSDP2's own
    (at most two non-zero terms per sum, as above)."""
    r = report[f"reduce_{dtype}"]
    assert r["reduce_scatter_dtypes"] == [{"fp16": "float16", "bf16": "bfloat16"}[dtype]], r
    assert r["calls"] == [3 * (3 + 2), 3 * 3], r
    assert r["moved"] > 1e-3, r  # 3 Adam steps at lr 1e-2 moved every tensor
    assert r["max_diff"] == 0.0, r


def test_fp16_reduction_is_legacy_ddps_fp16_all_reduce(report):
    """--fsdp2-reduce-dtype fp16 reduces the local fp16 gradients exactly as stock fairseq's
    legacy_ddp does with --fp16 (each divided by the world size in fp16, then summed in fp16):
    the same bits, at 2 and 4 ranks. FSDP2 divides by 2 before the sum and by world / 2 after
    it (about sqrt(world) each: _get_gradient_divide_factors), legacy_ddp by the world before:
    dividing by a power of two is exact in fp16 (above its subnormals) and commutes with
    rounding, and gloo associates the terms alike, so the results are equal. The default fp32
    reduction sums the same fp16 values without rounding to fp16 (these gradients' sums need
    more than fp16's 11 bits), so it differs from stock fairseq's.

    The price at more than 2 ranks: the fp16 sum of halves can overflow where legacy_ddp's sum
    of quarters (4 ranks) does not: 40,000 per rank is 80,000 after FSDP2's pre-division at 4
    ranks, beyond fp16's 65,504 (inf: fairseq's loss scaler then halves the scale and skips the
    step, on every rank), while legacy_ddp gets 40,000. At 2 ranks both divide by 2 first and
    neither overflows (a mean of finite fp16 values is finite)."""
    r = report["like_legacy_ddp"]
    assert r["reduce_fp16_equals_legacy_ddp"] and r["reduce_fp16_dtype"] == "float32", r
    assert not r["reduce_fp32_equals_legacy_ddp"], r
    big = r["gradient_40000"]
    assert big["legacy_ddp"] == [40000.0], big
    if report["world_size"] == 2:
        assert big["fsdp2"] == [40000.0], big
    else:
        assert big["fsdp2"] == [float("inf")], big
