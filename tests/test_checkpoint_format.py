"""Checkpoints outlive the code that wrote them: a sharded checkpoint written before the package
was reorganised into folders (tests/fixtures/checkpoint_before_layout, commit 0f18dca) resumes
with today's code and trains on as the run that wrote it did."""
import json
import shutil

from conftest import PLUGIN, REPO
from launcher import ok, run_ranks, train_inner
from numerics import FP32_REORDERED, printed_close

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_before_layout"


def test_a_checkpoint_written_before_the_layout_change_resumes_exactly(corpus, tmp_path):
    """Update 3 after resuming the old update-2 checkpoint on 2 ranks has the loss, nll_loss and
    gradient norm the old run printed for its own update 3. The same arithmetic on the same
    data: equal bits on the CPU that wrote the fixture; on another CPU the float32 kernels may
    sum in another order (FP32_REORDERED, numerics.py) on top of the printed digit."""
    save = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, save)
    flags = (FIXTURE / "flags.txt").read_text().split()
    want = json.loads((FIXTURE / "update_3.json").read_text())

    def args(rank):
        return [str(corpus), "--user-dir", PLUGIN, *flags, "--ddp-backend", "fsdp2",
                "--min-params-to-wrap", "1", "--max-update", "3", "--save-dir", str(save),
                "--restore-file", str(save / "checkpoint_1_2.pt"), "--no-save"]
    out = ok(run_ranks(2, args))
    assert "(epoch 1 @ 2 updates)" in out, out[-3000:]  # fairseq's "Loaded checkpoint" line
    records = train_inner(out)
    assert [r["num_updates"] for r in records] == ["3"], records
    for key in ("loss", "nll_loss", "gnorm"):
        assert printed_close(records[0][key], want[key], FP32_REORDERED, key), \
            (key, records[0][key], want[key])
