"""Real multi-process fairseq-train runs with the FSDP2 backend (gloo, CPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, stock_ddp
from launcher import base_env, free_port, ok, run_ranks, train_inner, train_summary

FSDP2 = ["--ddp-backend", "fsdp2", "--min-params-to-wrap", "1"]


def series(output, key):
    return [float(rec[key]) for rec in train_inner(output)]


def assert_close(a, b, rel=1e-4):
    assert len(a) == len(b) and a, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)


@pytest.mark.parametrize("optimizer, updates", [
    (["--optimizer", "adam", "--lr", "1e-3"], 20),
    (["--optimizer", "sgd", "--lr", "0.5"], 8),
])
def test_fsdp2_equals_stock_legacy_ddp(train_args, optimizer, updates):
    """Per-update loss and (clipped) gnorm equal fairseq's own 2-rank DDP on the same data."""
    ours = ok(run_ranks(2, lambda r: train_args(*FSDP2, *optimizer, updates=updates)))
    stock = ok(run_ranks(2, lambda r: train_args(*stock_ddp(r, 2), *optimizer,
                                                 updates=updates)))
    assert len(train_inner(ours)) == updates
    assert_close(series(ours, "loss"), series(stock, "loss"))
    assert_close(series(ours, "gnorm"), series(stock, "gnorm"))
    assert max(series(ours, "clip")) == 100  # --clip-norm really clipped some updates


def test_update_freq_without_sync_equals_stock(train_args):
    ours = ok(run_ranks(2, lambda r: train_args(*FSDP2, "--update-freq", "2",
                                                "--fsdp2-no-sync-micro-batches", updates=6)))
    stock = ok(run_ranks(2, lambda r: train_args(*stock_ddp(r, 2), "--update-freq", "2",
                                                 updates=6)))
    assert_close(series(ours, "loss"), series(stock, "loss"))
    assert_close(series(ours, "gnorm"), series(stock, "gnorm"))


def test_torchrun_without_distributed_flags(train_args, tmp_path):
    """The README's launch: torchrun + fairseq-train, plan and per-rank memory logged."""
    torchrun = Path(sys.executable).parent / "torchrun"
    fairseq_train = Path(sys.executable).parent / "fairseq-train"
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(fairseq_train), *train_args(*FSDP2, "--log-interval", "2", save=True, updates=6)]
    proc = subprocess.run(cmd, env=base_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "FSDP2 sharding plan: 6 units over 2 rank(s)" in out
    records = train_inner(out)
    assert [r["num_updates"] for r in records] == ["2", "4", "6"]
    for rec in records:
        assert 0 < float(rec["mem_peak_gb_min"]) <= float(rec["mem_peak_gb_max"])
        assert rec["mem_peak_rank"] in ("0", "1")
    lines = (tmp_path / "ckpt" / "memory.jsonl").read_text().splitlines()
    assert [json.loads(line)["num_updates"] for line in lines] == [2, 4, 6]
    for line in lines:
        ranks = json.loads(line)["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["peak_gb"] > 0 for r in ranks)


def test_single_process_without_torchrun(train_args):
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train",
                           *train_args(*FSDP2, updates=4)],
                          env=base_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "over 1 rank(s)" in proc.stdout
    assert len(train_inner(proc.stdout)) == 4


def test_legacy_nllb_flags_run_on_fsdp2(train_args):
    out = ok(run_ranks(2, lambda r: train_args(
        "--ddp-backend", "fully_sharded", "--min-params-to-wrap", "100000000",
        "--no-reshard-after-forward", updates=4)))
    assert "--ddp-backend fully_sharded is served by PyTorch FSDP2" in out
    assert "wraps no layer" in out  # the 1e8 threshold keeps every layer in the root
    assert len(train_inner(out)) == 4


def test_root_reshard_setting_takes_effect(corpus):
    """After forward, the root and shared-embedding parameters stay gathered by default and
    are resharded with --fsdp2-root-reshard always; layer units reshard in both. Inside
    apply.all_unsharded (validation generating for --eval-bleu) every unit stays gathered, and
    the settings hold again after it."""
    out = ok(run_ranks(2, lambda r: [str(corpus)], module="reshard_probe",
                       env={"PYTHONPATH": str(REPO / "tests" / "probes")}))
    report = json.loads(next(l for l in out.splitlines() if l.startswith("PROBE "))[6:])
    # while validation generates (--eval-bleu) everything stays gathered, whatever number of
    # forwards each rank runs; afterwards each unit's own setting holds again
    for setting in report.values():
        assert setting.pop("generating") == {"root": "gathered", "layer": "gathered"}
    assert report["default"].pop("after") == {"root": "gathered", "layer": "resharded"}
    assert report["always"].pop("after") == {"root": "resharded", "layer": "resharded"}
    assert report["default"] == {"root": "gathered", "shared": "gathered",
                                 "layer": "resharded"}
    assert report["always"] == {"root": "resharded", "shared": "resharded",
                                "layer": "resharded"}


def test_four_ranks_reshard_degree_and_hsdp_match_plain_fsdp(train_args):
    plain = ok(run_ranks(4, lambda r: train_args(*FSDP2, updates=3)))
    degree = ok(run_ranks(4, lambda r: train_args(*FSDP2, "--fsdp2-reshard-degree", "2",
                                                  updates=3)))
    hsdp = ok(run_ranks(4, lambda r: train_args(*FSDP2, "--fsdp2-replicate-degree", "2",
                                                "--fsdp2-root-reshard", "always", updates=3)))
    assert "to groups of 2 ranks" in degree
    for other in (degree, hsdp):
        assert_close(series(other, "loss"), series(plain, "loss"))
        assert_close(series(other, "gnorm"), series(plain, "gnorm"))


def test_fp16_overflow_skips_on_every_rank_and_trains(train_args):
    out = ok(run_ranks(2, lambda r: train_args(*FSDP2, "--fp16", "--fp16-init-scale",
                                               str(2 ** 26), updates=12)))
    assert out.count("gradient overflow detected") >= 3  # scale halves until it fits
    records = train_inner(out)
    assert len(records) == 12  # skipped steps are not counted, as in fairseq
    scales = [float(r["loss_scale"]) for r in records]
    assert scales[-1] < 2 ** 26
    losses = series(out, "loss")
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("flags", [["--bf16"], ["--memory-efficient-fp16"],
                                   ["--checkpoint-activations", "--cpu-offload"]])
def test_precision_and_memory_options_train(train_args, flags):
    out = ok(run_ranks(2, lambda r: train_args(*FSDP2, *flags, updates=10)))
    losses = series(out, "loss")
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5




def test_loss_scale_floor_stops_every_rank_naming_update_and_rank(train_args):
    results = run_ranks(2, lambda r: train_args(*FSDP2, "--fp16", "--fp16-init-scale",
                                                str(2 ** 26), "--min-loss-scale", str(2 ** 22),
                                                updates=4))
    for r in results:
        assert r.returncode != 0
        assert "Minimum loss scale reached" in r.output
        assert f"(at update 1, rank {r.rank})" in r.output, r.output[-2000:]
