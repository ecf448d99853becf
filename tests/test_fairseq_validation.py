"""fairseq's validation under FSDP2 as under stock legacy_ddp (docs/compatibility.md's rows
name these tests): ``--eval-bleu`` with the best checkpoint chosen by BLEU and ``--patience``, a
kill and rerun keeping the best score and the patience count, stock checkpoints that hold numpy,
starting from stock's checkpoint in three ways and going back to stock from the plugin's, and
resuming at another world size. One scenario (tests/scenarios.py), tolerances as in
tests/test_fairseq_compat.py's module docstring; BLEU is compared where both runs decode alike
(tests/greedy_ties.py).
"""
from __future__ import annotations

import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from numerics import printed_close
from scenarios import (REL, assert_resumed_exactly, assert_same_training, checkpoint_files,
                       resumed_at, summary, tiny_model_scenario, updates, valid_records)


# --- scenario "validation": --eval-bleu, best checkpoint by bleu, patience --------------------------
VALIDATION = ["--max-tokens", "1000", "--dropout", "0", "--log-format", "json",
              "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 20}',
              "--eval-bleu-detok", "space", "--eval-bleu-remove-bpe",
              "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
              "--validate-interval-updates", "4", "--save-interval-updates", "4",
              "--keep-best-checkpoints", "2", "--patience", "2", "--max-update", "1000"]


@pytest.fixture(scope="module")
def validation(corpus, tmp_path_factory):
    return tiny_model_scenario(corpus, tmp_path_factory, "validation", VALIDATION)


@pytest.fixture(scope="module")
def near_ties(validation) -> dict[int, list[str]]:
    """Each validation point (update) -> the sentences the two runs' saved weights decode
    otherwise, each a near tie (tests/greedy_ties.py). The replays reproduce the BLEU each run
    logged there, so these are the decodings the runs scored."""
    from greedy_ties import Replay, checkpoints_by_update, divergences
    saved = {label: checkpoints_by_update(validation.save_dir(label))
             for label in ("fsdp2", "stock")}
    ties = {}
    for a, b in zip(valid_records(validation.fsdp2), valid_records(validation.stock)):
        n = int(a["valid_num_updates"])
        replays = {}
        for label, record in (("fsdp2", a), ("stock", b)):
            assert n in saved[label], (label, n, sorted(saved[label]))
            replays[label] = Replay(saved[label][n])
            # fairseq logs BLEU rounded to 2 decimals
            assert abs(replays[label].bleu - float(record["valid_bleu"])) <= 0.005 + 1e-9, \
                (label, n, replays[label].bleu, record)
        ties[n] = divergences(replays["fsdp2"], replays["stock"])
    return ties


def bleu_decided_alike(near_ties) -> None:
    """Skip a test of what BLEU decides (patience, the best checkpoints) when a near tie let
    the two runs decode a sentence otherwise: then their BLEU may differ by chance."""
    tied = {n: found for n, found in near_ties.items() if found}
    if tied:
        pytest.skip(f"near ties in greedy decoding (the runs' weights differ by rounding), so "
                    f"BLEU may differ by chance: {tied}")


@pytest.mark.slow
def test_eval_bleu_validation_figures_as_stock(validation, near_ties):
    """The same validation points and losses as stock; the same BLEU wherever both runs' weights
    decode every sentence alike (elsewhere each difference is a near tie: ``near_ties``)."""
    ours, stock = valid_records(validation.fsdp2), valid_records(validation.stock)
    assert len(ours) == len(stock) >= 3
    for a, b in zip(ours, stock):
        assert a["valid_num_updates"] == b["valid_num_updates"], (a, b)
        if not near_ties[int(a["valid_num_updates"])]:
            assert a["valid_bleu"] == b["valid_bleu"], (a, b)
        assert printed_close(a["valid_loss"], b["valid_loss"], REL, "valid_loss"), (a, b)
    assert_same_training(updates(validation.fsdp2), updates(validation.stock))
    print(f"validation points decoded alike: {sum(not t for t in near_ties.values())} of "
          f"{len(near_ties)}; near ties: {near_ties}")


@pytest.mark.slow
def test_patience_stops_at_the_same_update_as_stock(validation, near_ties):
    bleu_decided_alike(near_ties)
    stop = "early stop since valid performance hasn't improved for last 2 runs"
    assert stop in validation.fsdp2 and stop in validation.stock
    assert max(updates(validation.fsdp2)) == max(updates(validation.stock))


def pickled(path: Path) -> bytes:
    """The pickle inside a torch.save zip file (the names of every class it references)."""
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


@pytest.mark.slow
def test_best_checkpoints_by_bleu_are_the_same_files_and_hold_no_numpy(validation, near_ties):
    """--best-checkpoint-metric bleu --maximize-best-checkpoint-metric --keep-best-checkpoints
    2: the same files as stock; fairseq pickles the BLEU meters' numpy arrays, the plugin
    writes tensors and Python floats."""
    bleu_decided_alike(near_ties)
    kept = checkpoint_files(validation.save_dir("fsdp2"))
    assert kept == checkpoint_files(validation.save_dir("stock"))
    assert len([k for k in kept if k.startswith("checkpoint.best_bleu_")]) == 2
    ours = validation.save_dir("fsdp2") / "checkpoint_best.pt"
    stock = validation.save_dir("stock") / "checkpoint_best.pt"
    assert torch.load(ours, weights_only=True)["extra_state"]["best"] == \
        torch.load(stock, weights_only=True)["extra_state"]["best"]
    assert b"numpy" in pickled(stock)
    assert b"numpy" not in pickled(ours)


VALID_FIELDS = ("valid_num_updates", "valid_loss", "valid_bleu", "valid_best_bleu")


@pytest.fixture(scope="module")
def validation_killed(validation):
    """The same command rerun on a save dir holding what a kill in the first update after the
    epoch-end save leaves: that save as checkpoint_last.pt, its shards beside it. It is the
    uninterrupted run's checkpoint1.pt, the same command's save at that point, with the best
    score and the patience count so far (1 here): the file a kill of that run right after the
    save would leave (saves are synchronous here: a SIGKILL after one changes none of its
    files), where a killed run made it again before (2 ranks: the updates from the last save
    before the epoch end, a validation, the save). As tests/test_fairseq_compat.py's
    ``epochs_killed`` starts."""
    save, uninterrupted = validation.save_dir("killed"), validation.save_dir("fsdp2")
    epoch_end = torch.load(uninterrupted / "checkpoint1.pt", weights_only=True)
    end = epoch_end["optimizer_history"][-1]["num_updates"]
    shards = epoch_end["fsdp2"]["shards"]
    shutil.copytree(uninterrupted / shards, save / shards)
    shutil.copy(uninterrupted / "checkpoint1.pt", save / "checkpoint_last.pt")
    return end, validation.run("killed")


@pytest.mark.slow
def test_best_score_and_patience_count_survive_a_restart(validation, validation_killed):
    """The rerun resumes at the epoch end with fairseq's best BLEU and the plugin's saved
    patience count: the uninterrupted run's updates and validation figures, and it stops where
    that run stopped (stock fairseq restarts the patience count on resume and stops later)."""
    end, out = validation_killed
    assert resumed_at(out) == end
    assert_resumed_exactly(updates(out), updates(validation.fsdp2), end + 1)
    after = [{k: r.get(k) for k in VALID_FIELDS} for r in valid_records(out)]
    whole = [{k: r.get(k) for k in VALID_FIELDS} for r in valid_records(validation.fsdp2)]
    assert after and after == whole[-len(after):]
    assert "early stop" in out and max(updates(out)) == max(updates(validation.fsdp2))


# --- loading stock checkpoints that hold numpy ----------------------------------------------------

@pytest.mark.slow
def test_numpy_in_stock_checkpoints_loads_and_other_classes_are_refused(validation, tmp_path):
    from fairseq_fsdp2.checkpoint.safe_load import read_checkpoint_file
    from fairseq_fsdp2.errors import CheckpointError
    stock = validation.save_dir("stock") / "checkpoint_best.pt"
    assert b"numpy._core.multiarray\n_reconstruct" in pickled(stock)
    assert read_checkpoint_file(str(stock))["extra_state"]["best"] > -1
    # arrays too, and files written under numpy 1.x (module numpy.core.multiarray)
    import numpy as np
    legacy = tmp_path / "numpy1.pt"
    torch.save({"model": {}, "a": np.arange(3.0), "s": np.int64(2)}, legacy,
               _use_new_zipfile_serialization=False)
    legacy.write_bytes(legacy.read_bytes().replace(b"numpy._core.multiarray",
                                                   b"numpy.core.multiarray"))
    state = read_checkpoint_file(str(legacy))
    assert state["a"].tolist() == [0.0, 1.0, 2.0] and state["s"] == 2
    # never arbitrary code: an object array, or any other class, is refused with its name
    for value, name in ((np.array([{"x": 1}], dtype=object), "numpy.dtypes.ObjectDType"),
                        (np.array(["a"]), "numpy.dtypes.StrDType"),
                        (Path("x"), "pathlib.")):
        path = tmp_path / "other.pt"
        torch.save({"model": {}, "v": value}, path)
        with pytest.raises(CheckpointError, match=f"it pickles {re.escape(name)}"):
            read_checkpoint_file(str(path))


@pytest.fixture(scope="module")
def from_stock(validation):
    """Both backends start from stock fairseq's checkpoint_best.pt of the validation scenario
    (trained with --eval-bleu: numpy inside), a few updates each:
    - ``finetune``: --finetune-from-model (fresh optimizer, lr scheduler, meters, data);
    - ``restore``: --restore-file with --reset-lr-scheduler --reset-meters --reset-dataloader
      and --optimizer-overrides (the stock optimizer state is resharded into FSDP2's). The
      override is Adam's eps, raised enough to shrink the updates visibly: an lr override
      would be replaced by the lr scheduler's value at every update, in both backends;
    - ``reset``: --restore-file with --reset-optimizer --reset-lr-scheduler --reset-meters, the
      data loader kept: the classic fine-tuning command line. The weights are broadcast from
      rank 0 (no rank but 0 holds the full model); training continues from update 1 in the
      epoch after the checkpoint's, as stock fairseq does;
    - ``from-fsdp2``: the same flags, from the plugin's own (sharded) checkpoint_best.pt.
    Stock fairseq's own runs of ``finetune`` and ``restore`` (which reset the data loader) run
    on 1 rank x --update-freq 2, one process fewer each: the same global batches in the same
    updates (the scenario has no dropout), whose gradient sums differ from the 2-rank fsdp2
    run's only in their order, as fsdp2 vs legacy_ddp's do: within REL (module docstring,
    test_resume_at_epoch_end_on_one_rank_with_double_update_freq). ``reset`` and
    ``from-fsdp2`` keep the data loader's position (the best checkpoint may be mid-epoch),
    counted in batches of a rank, which 1 rank would read otherwise: both on 2 ranks."""
    best = validation.save_dir("stock") / "checkpoint_best.pt"
    trained = torch.load(best, weights_only=True)["optimizer_history"][-1]["num_updates"]
    runs = {}
    for kind, extra, first in (
            ("finetune", ["--finetune-from-model", best, "--max-update", 3,
                          "--log-format", "tqdm"], 1),  # tqdm: without --no-progress-bar
            ("restore", ["--restore-file", best, "--reset-lr-scheduler", "--reset-meters",
                         "--reset-dataloader", "--optimizer-overrides", "{'eps': 0.1}",
                         "--max-update", trained + 3], trained + 1),
            ("reset", ["--restore-file", best, "--reset-optimizer", "--reset-lr-scheduler",
                       "--reset-meters", "--max-update", 3], 1),
            ("from-fsdp2", ["--restore-file", validation.save_dir("fsdp2") / "checkpoint_best.pt",
                            "--reset-optimizer", "--reset-lr-scheduler", "--reset-meters",
                            "--max-update", 3], 1)):
        for backend in ("fsdp2", "stock"):
            # stock fairseq alone, trusting its own file; from the plugin's file, with the
            # plugin (its reading of sharded checkpoints is what is tested there)
            stock_alone = backend == "stock" and kind != "from-fsdp2"
            one_rank = stock_alone and kind != "reset"
            runs[kind, backend] = validation.run(
                f"{kind}-{backend}", *extra, "--no-save", "--disable-validation",
                *(["--update-freq", 2] if one_rank else []), ranks=1 if one_rank else 2,
                backend=backend, without=("--no-progress-bar",),
                plugin=not stock_alone, trusting=(best,) if stock_alone else ())
        runs[kind, "first"] = first
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["finetune", "restore", "reset"])
def test_starting_from_a_stock_eval_bleu_checkpoint_as_stock(from_stock, kind):
    """--finetune-from-model, --restore-file with the stock optimizer state resharded and
    --reset-lr-scheduler --reset-meters --reset-dataloader --optimizer-overrides, or
    --restore-file with --reset-optimizer --reset-lr-scheduler --reset-meters (the data
    loader's position kept), from a stock checkpoint holding numpy: the same updates as stock
    fairseq from the same file."""
    ours, stock = from_stock[kind, "fsdp2"], from_stock[kind, "stock"]
    first = from_stock[kind, "first"]
    # with the optimizer reset, the weights come broadcast from rank 0 (no full copy per rank)
    assert ("loaded pretrained weights from" in ours) == (kind != "restore")
    if kind == "finetune":  # --log-format tqdm: no per-update lines; the epoch's averages
        a, b = summary(ours), summary(stock)
        assert a["train_num_updates"] == b["train_num_updates"] == "3", (a, b)
        assert_same_training({0: (a["train_loss"], a["train_gnorm"])},
                             {0: (b["train_loss"], b["train_gnorm"])})
        return
    assert sorted(updates(ours)) == [first, first + 1, first + 2]
    assert_same_training(updates(ours), updates(stock))


@pytest.mark.slow
def test_stock_legacy_ddp_goes_on_from_an_fsdp2_checkpoint_with_a_new_optimizer(from_stock):
    """Back to stock DDP: legacy_ddp given the plugin's sharded checkpoint_best.pt with
    --reset-optimizer reads its full weights (registration.py's patch 8) and makes the same
    updates as FSDP2 from the same file. (Without --reset-optimizer: one line, docs/errors.md.)"""
    ours, stock = from_stock["from-fsdp2", "fsdp2"], from_stock["from-fsdp2", "stock"]
    assert sorted(updates(stock)) == [1, 2, 3]
    assert_same_training(updates(ours), updates(stock))


# --- resuming at another world size ----------------------------------------------------------------

@pytest.mark.slow
def test_resume_at_epoch_end_on_one_rank_with_double_update_freq(validation):
    """The validation scenario (no dropout) resumed from its first epoch-end checkpoint on 1 rank
    x update-freq 2: the same global batches, so the same updates (module docstring)."""
    uninterrupted = updates(validation.fsdp2)
    save = validation.save_dir("fsdp2")
    epoch_end = torch.load(save / "checkpoint1.pt", weights_only=True)
    start = epoch_end["optimizer_history"][-1]["num_updates"]
    assert epoch_end["extra_state"]["train_iterator"]["iterations_in_epoch"] == 0
    end = min(start + 3, max(uninterrupted))  # where --patience stopped that run
    assert end > start
    out = validation.run("one-rank", "--restore-file", save / "checkpoint1.pt",
                         "--update-freq", 2, "--max-update", end, "--disable-validation",
                         "--no-save", ranks=1, backend="fsdp2")
    made = updates(out)
    assert sorted(made) == list(range(start + 1, end + 1))
    assert_same_training(made, {n: uninterrupted[n] for n in made})
