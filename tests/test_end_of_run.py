"""The end of a successful run (``process/lifecycle.py``): every rank meets once more, closes the
run (the process group destroyed, the heartbeat thread stopped) and returns; the process then
ends as any Python program does, running its exit handlers (fairseq's TensorBoard writers,
wandb) once; rank 0 alone exports the consolidated checkpoints first, with no collective left
that a slow export could time out, holding at most one full copy of the model.

One real 2-rank run feeds the first tests (tests/probes/end_of_run.py watches it): 8 updates,
--tensorboard-logdir, a short --heartbeat-timeout and a consolidated export slowed down to
outlast it. TensorBoard is test-only (requirements-dev.txt, installed by scripts/setup.sh into
.venv/fixture-deps): fairseq looks for it when it is imported, before that folder is on the
path of a rank forked from the tests' fork server, so the probe redoes that lookup (fresh
interpreters importing torch and fairseq cost half this test's time on 2 cores).
"""
import json
import os
import shutil
import sys
import weakref

import pytest
import torch

from conftest import FIXTURE_DEPS, PLUGIN, REPO, TINY_MODEL, TRAINING, need_fixture_dep
from launcher import run_ranks, train_inner

PROBES = str(REPO / "tests" / "probes")
#: 4 log intervals, each with its own memory peak in the TensorBoard events (the exit and the
#: export do not depend on how long the run trained: 8 updates, where 20 logged every 5 were 12
#: updates on 2 ranks more)
UPDATES, LOG_EVERY = 8, 2
#: --heartbeat-timeout: it bounds the rendezvous of the two ranks and every collective of the run,
#: so it must outlast a rank descheduled on a loaded 2-core machine; the ranks' imports (seen
#: taking 2 minutes at load 20, ranks apart by seconds) are outside it: the probe starts the run
#: once both have imported (probes/end_of_run.py). The export is made to last longer than it
TIMEOUT_S = 10


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    need_fixture_dep("tensorboard", "for --tensorboard-logdir")
    root = tmp_path_factory.mktemp("end-of-run")
    (root / "end").mkdir()
    args = [corpus, "--user-dir", PLUGIN, *TINY_MODEL, *TRAINING, "--ddp-backend", "fsdp2",
            "--num-workers", "0", "--max-update", UPDATES, "--log-interval", LOG_EVERY,
            "--save-dir", root / "ckpt", "--no-epoch-checkpoints",
            "--tensorboard-logdir", root / "tb", "--heartbeat-timeout", TIMEOUT_S]
    env = {"PYTHONPATH": os.pathsep.join([PROBES, str(FIXTURE_DEPS),
                                          os.environ.get("PYTHONPATH", "")]),
           "END_DIR": str(root / "end"), "SLOW_EXPORT_S": str(TIMEOUT_S + 1)}
    results = run_ranks(2, lambda r: args, module="end_of_run", env=env, timeout=400)  # loaded: slow
    return root, results


@pytest.mark.slow
def test_successful_ranks_exit_0_after_running_their_exit_handlers(finished):
    root, results = finished
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.output[-4000:]}"
        assert (root / "end" / f"atexit-rank{r.rank}").is_file(), f"rank {r.rank}'s atexit"


@pytest.mark.slow
def test_tensorboard_events_hold_the_memory_peak_of_every_log_interval(finished):
    root, results = finished
    printed = {int(r["num_updates"]): float(r["mem_peak_gb_max"])
               for r in train_inner(results[0].output)}
    assert sorted(printed) == list(range(LOG_EVERY, UPDATES + 1, LOG_EVERY))
    sys.path.insert(0, str(FIXTURE_DEPS))
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    finally:
        sys.path.remove(str(FIXTURE_DEPS))
    events = EventAccumulator(str(root / "tb" / "train_inner"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("mem_peak_gb_max")}
    assert sorted(logged) == sorted(printed)
    for step, value in printed.items():
        # tensorboard stores float32: 3-decimal values of about 1 GB are off by < 1e-7
        assert abs(logged[step] - value) < 1e-6, (step, logged[step], value)


@pytest.mark.slow
def test_other_ranks_leave_while_rank_0_exports_longer_than_the_timeout(finished):
    """The probe holds rank 0's export (before it reads the shards) until rank 1's process has
    ended and SLOW_EXPORT_S > --heartbeat-timeout has passed, or GIVE_UP_S. That length is the
    probe's doing, the premise, not a finding (export.json exists only if the export went
    through the slowed function). What can fail: rank 1 must have ended while the export was
    held (had it waited for rank 0 in a collective, it could not: the probe would give up with
    peers_ended false, or rank 1 would time out and exit non-zero), and both ranks exit 0 (a
    collective of rank 0's after the export would fail, its peer gone)."""
    root, results = finished
    seen = json.loads((root / "end" / "export.json").read_text())
    assert seen["peers_ended"], seen
    assert [r.returncode for r in results] == [0, 0]
    state = torch.load(root / "ckpt" / "checkpoint_last_consolidated.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == UPDATES
    assert "last_optimizer_state" not in state and torch.is_tensor(
        state["model"]["decoder.output_projection.weight"])


@pytest.mark.slow
def test_the_export_holds_one_full_copy_at_a_time(finished, tmp_path, monkeypatch):
    from fairseq_fsdp2.checkpoint import export, sharded

    import torch.distributed.checkpoint as dcp

    root, _ = finished
    last = torch.load(root / "ckpt" / "checkpoint_last.pt", weights_only=True)
    aliases = last["fsdp2"]["aliases"]
    # the run's own export of its last save (rank 0 wrote it at the end of training)
    final = torch.load(root / "ckpt" / "checkpoint_last_consolidated.pt",
                       weights_only=True)["model"]
    reads, alive = [], []
    real = export._fsdp2_model

    def watched(*args):
        reads.append(sum(ref() is not None for ref in alive))  # copies held as a read starts
        model = real(*args)
        alive.extend(weakref.ref(t) for t in model.values())
        return model
    monkeypatch.setattr(export, "_fsdp2_model", watched)
    requested = []
    real_load = export.dcp.load

    def load(state_dict, **kwargs):
        requested.append(set(state_dict["model"]))
        return real_load(state_dict, **kwargs)
    monkeypatch.setattr(export.dcp, "load", load)

    for case in ("same shards", "other shards"):
        save = tmp_path / case.replace(" ", "-")
        shutil.copytree(root / "ckpt", save)
        for name in os.listdir(save):
            if name.endswith("_consolidated.pt"):
                os.remove(save / name)
        best = dict(last)
        if case == "other shards":  # the best checkpoint was an earlier save: other weights
            best["fsdp2"] = {**last["fsdp2"], "shards": last["fsdp2"]["shards"] + "-best"}
            # every weight of the last save plus one, so an export that read the other
            # directory cannot pass (the tied embedding once, under its canonical name)
            dcp.save({"model": {k: v + 1 for k, v in final.items() if k not in aliases}},
                     checkpoint_id=str(save / best["fsdp2"]["shards"]), no_dist=True)
        torch.save(best, save / "checkpoint_best.pt")
        reads.clear()
        requested.clear()
        written = export.consolidate_at_end(str(save))
        assert [os.path.basename(p) for p in written] == ["checkpoint_best_consolidated.pt",
                                                          "checkpoint_last_consolidated.pt"]
        assert reads == ([0] if case == "same shards" else [0, 0]), case
        # the shards hold the tied embedding under all 3 names; it is read once
        assert set(aliases) == {"decoder.embed_tokens.weight", "decoder.output_projection.weight"}
        assert all(keys.isdisjoint(aliases) for keys in requested) and requested
        a, b = (torch.load(p, weights_only=True)["model"] for p in written)  # best, last
        assert a.keys() == b.keys() == final.keys()
        assert all(torch.equal(b[k], final[k]) for k in b)  # last: the run's own weights
        shift = 0 if case == "same shards" else 1  # best: its own shards'
        assert all(torch.equal(a[k], final[k] + shift) for k in a)
        assert len(sharded.referenced_dirs(str(save))) == (1 if case == "same shards" else 2)
