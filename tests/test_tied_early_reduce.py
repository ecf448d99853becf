"""The tied embedding's gradient reduced early (sharding/tied_grad_reduce.py): the output
projection's part into this rank's shard as backward starts, the lookups' rows exchanged at its
end, against FSDP2's own reduction of the tied-gradient buffer (--fsdp2-no-tied-early-reduce).

1. The sharded gradient itself (tests/probes/tied_early_reduce_probe.py), per element within
   its derived rounding bound: fp32, fp16 and bf16 reduce dtypes (16-bit shards kept, as the
   trainer keeps them), the fused loss and the plain projection, the rows' exchange and the
   rows folded into the dense path, uneven shards, several reduce calls, accumulation onto a
   kept gradient, the path NCCL takes (torch's reduce-scatter, run here by gloo: from the
   buffer itself with even shards, from chunks of it with uneven ones); on 2 ranks and on an
   HSDP 2 x 2 mesh.
2. fairseq-train on 2 ranks with a vocabulary large enough for the rows' exchange: per-update
   loss and gradient norm against the option off, --fp16 --fsdp2-reduce-dtype fp16 (fp32: on
   tests/test_memory_breakdown.py's runs, which make that pair of runs anyway:
   test_tied_early_reduce_matches_fsdp2s_reduction_in_fp32).
3. The one rule (tied_grad_reduce.applies) deciding for training and the estimator alike.
(The measured memory of update 2 with it: tests/test_memory_breakdown.py.)
"""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO, train_args_for
from launcher import ok, run_ranks
from numerics import U16, assert_runs_close
from scenarios import FSDP2

from fairseq_fsdp2.sharding.tied_grad_reduce import sparse_fits

PROBES = str(REPO / "tests" / "probes")


def probe(mesh: str, ranks: int) -> dict:
    out = ok(run_ranks(ranks, lambda r: [mesh], module="tied_early_reduce_probe",
                       env={"PYTHONPATH": PROBES}))
    return json.loads(next(line for line in out.splitlines() if line.startswith("PROBE "))[6:])


def check(report: dict) -> None:
    for case, r in report.items():
        # within the per-element bound (the probe's run_case derives it), nonzero, laid out and
        # typed as FSDP2's own sharded gradient
        assert r["ratio"] <= 1.0, (case, r)
        assert r["nonzero"] and r["dtensor"] and r["dtype"] == r["stock_dtype"], (case, r)
        # the lookups' rows weigh more than the bound somewhere: a gradient without them fails
        assert r["rows_ratio"] > 1.0, (case, r)
        # the projection's vocab x dim part reduced and freed before the lookups' backward
        assert r["freed_before_rows"], (case, r)


def test_early_reduce_gives_fsdp2s_sharded_gradient():
    report = probe("2", 2)
    assert len(report) == 8
    check(report)
    assert report["sparse fp16 fused"]["dtype"] == "torch.float16"  # the kept 16-bit shard


def test_early_reduce_gives_fsdp2s_sharded_gradient_under_hsdp():
    """HSDP: reduce-scattered over the shard group, then all-reduced over the replicas; the
    rows gathered from all 4 ranks."""
    report = probe("2x2", 4)
    assert len(report) == 2
    check(report)


#: the dictionary grown to this many entries: rows' exchange chosen (below)
VOCAB = 4096
#: 2 updates: update 1's gradient norm is the first reduced gradient's (the rows' exchange
#: skipped shows there), update 2's loss the step made with it and its gradient norm the next
#: reduce into a cleared shard; a third repeats update 2
MAX_TOKENS, UPDATES = 500, 2


@pytest.fixture(scope="module")
def big_vocab_corpus(corpus, tmp_path_factory):
    """The tiny corpus with its (joined) dictionary grown to VOCAB entries: unused words at
    the end, so the binarized data stays valid."""
    target = tmp_path_factory.mktemp("big_vocab") / "bin"
    shutil.copytree(corpus, target)
    for side in ("src", "tgt"):
        path = target / f"dict.{side}.txt"
        lines = path.read_text().splitlines()
        extra = VOCAB - 4 - len(lines)  # fairseq's 4 special symbols come first
        path.write_text("\n".join(lines + [f"unused{i} 1" for i in range(extra)]) + "\n")
    return target


def test_fairseq_train_matches_fsdp2s_reduction_in_fp16(big_vocab_corpus, tmp_path):
    """Per update, loss and gradient norm of the early reduce against FSDP2 reducing the
    buffer (--fsdp2-no-tied-early-reduce), fused chunked loss, 2 ranks, --fp16
    --fsdp2-reduce-dtype fp16 (the fp32 case runs on tests/test_memory_breakdown.py's runs,
    which make that pair anyway: test_tied_early_reduce_matches_fsdp2s_reduction_in_fp32).

    The rows' exchange is what runs: each rank's lookups are at most 2 x MAX_TOKENS rows, and
    2 ranks' of them fit the dense gradient's fp16 bytes (asserted here with the rule itself).
    DERIVED tolerance: the two runs differ only in how the tied weight's gradient is grouped:
    FSDP2 sums (projection + src lookup + tgt lookup) per rank, then over the 2 ranks; here the
    projections over the ranks, then each lookup's rows. Counting each lookup's rows as one
    term (as tests/test_chunked_loss.py's tolerance does), 6 terms per element, each addition
    rounding by at most u of the terms' magnitude in either order: 2 x (6 + 1) x U16 per
    element (the fp16 buffer and reduce dtype), which moves the gradient norm and Adam's step
    by at most that fraction (the triangle inequality; m / sqrt(v) per element), over these 2
    updates."""
    assert sparse_fits(2 * 2 * MAX_TOKENS, 32, 2, VOCAB)
    flags = ["--criterion", "label_smoothed_cross_entropy_chunked", "--loss-chunk-tokens", "128",
             "--fp16", "--fsdp2-reduce-dtype", "fp16"]
    outputs = []
    for extra in ([], ["--fsdp2-no-tied-early-reduce"]):
        outputs.append(ok(run_ranks(2, lambda r: train_args_for(
            big_vocab_corpus, tmp_path / str(len(outputs)), *FSDP2, *flags, *extra,
            updates=UPDATES))))
    early, stock = outputs
    assert "reduced into this rank's shard" in early
    assert "reduced into this rank's shard" not in stock
    assert_runs_close(early, stock, 2 * (6 + 1) * U16, UPDATES)


@pytest.mark.parametrize("flags, world, expected", [
    ([], 2, True),
    (["--update-freq", "2"], 2, True),  # reduced every micro-batch, added to the shard
    ([], 1, False),  # nothing to reduce
    (["--fsdp2-replicate-degree", "2"], 2, False),  # a shard group of one rank
    (["--fsdp2-replicate-degree", "2"], 4, True),  # HSDP
    (["--cpu-offload"], 2, False),  # FSDP2 moves the gradients to the CPU
    (["--fsdp2-no-sync-micro-batches", "--update-freq", "2"], 2, False),
    (["--fsdp2-no-tied-grad-buffer"], 2, False),
    (["--fsdp2-no-tied-early-reduce"], 2, False),
])
def test_one_rule_decides_for_training_and_the_estimate(flags, world, expected):
    """sharding/tied_grad_reduce.applies, which the trainer calls, decides the estimator's
    setup too (estimator/from_args.py), from fairseq-train's own parsed arguments."""
    from fairseq_fsdp2.estimator import from_args
    from fairseq_fsdp2.sharding.tied_grad_reduce import applies
    args = from_args.parse(["unused", "--task", "translation", "--arch",
                            "transformer_nllb_600m", "--vocab-size", "256206", "--ddp-backend",
                            "fsdp2", "--max-tokens", "1024", *flags])
    update_freq = int(args.update_freq[0])
    assert applies(args, world // args.fsdp2_replicate_degree, update_freq) is expected
    assert from_args.setup_for(args, world).tied_early_reduce is expected
