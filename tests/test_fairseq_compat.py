"""fairseq's training features under FSDP2, exactly as under stock legacy_ddp: the compatibility
matrix of docs/compatibility.md ("fairseq features under FSDP2"), whose rows name the tests below.

Features that do not interfere share a scenario: one command line, run once with the plugin's
``--ddp-backend fsdp2`` (2 ranks) and once with stock fairseq's own 2-rank ``legacy_ddp``
(module-scoped fixtures). Stock runs do not load the plugin (no ``--user-dir``), so a bug in its
global patches cannot cancel out of a comparison; only a stock run that reads the plugin's own
checkpoint loads it. Each feature's test then checks its part of those runs: per-update
loss and gnorm, validation figures, which files were kept, where training stopped, exit 0.
Stateful features are also killed (SIGKILL, every rank, tests/probes/fault_point.py) and rerun
with the same command; every update the rerun makes equals the uninterrupted fsdp2 run's.

Tolerances: fsdp2 vs legacy_ddp reduce gradients in another order (reduce-scatter of shards vs
all-reduce of buckets), so their float32 sums differ in the last bits: the true values are
within tests/numerics.py's FP32_REORDERED (1e-4 relative, derived there; tests/test_backend.py
uses the same bound), and the printed ones within that plus fairseq's printed rounding
(``numerics.printed_close``: half a unit of the key's round= decimal on each side, so values
whose true difference is 1e-7 but which straddle a rounding boundary still pass), while any
feature acting differently (another batch, another lr, a skipped update) moves the loss by
>1e-3. The same run resumed at the same world size computes the same sums in the same order:
its printed values are compared as exact strings. Resumed at another world size (2 ranks -> 1
rank x update-freq 2), the two micro-batches' gradients are summed in the backward instead of
over the ranks (same terms, 1 ulp apart at most): FP32_REORDERED again, and only without
dropout, because fairseq seeds dropout per update, not per micro-batch (the same mask stream on
every rank).

The scenarios and log readers: tests/scenarios.py; the validation scenario:
tests/test_fairseq_validation.py.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import PLUGIN, REPO, TINY_MODEL
from launcher import run_ranks, train_inner
from scenarios import (BASE, FSDP2, PROBES, Scenario, assert_resumed_exactly,
                       assert_same_training, checkpoint_files, resumed_at, tiny_model_scenario,
                       updates)

from fairseq_fsdp2.data import numbers
from fairseq_fsdp2.data.prepare import prepare


# --- scenario "epochs": --batch-size, --update-freq per epoch, --max-epoch, saves -----------------
# Trained on the validation split, 100 sentences, in batches of 7 (--required-batch-size-multiple
# 1; with fairseq's default of 8: 14 batches, 98 sentences): 15 batches, 8 per rank (rank 1's
# eighth is fairseq's empty filler of the shorter shard, a dummy batch); --update-freq
# 1,2: updates 1-8 in epoch 1, 9-12 in epoch 2, 13-16 in epoch 3. Saves every 3 updates and at
# every epoch end. (The same layout the training split's 2000 sentences in batches of 128 gave,
# at a twentieth of the sentences.) Dropout 0.1 (conftest's model): the kill-and-rerun chain is
# exact with dropout on.
EPOCHS = ["--train-subset", "valid", "--batch-size", "7", "--required-batch-size-multiple", "1",
          "--update-freq", "1,2", "--max-epoch", "3",
          "--save-interval-updates", "3", "--keep-interval-updates", "2",
          "--log-format", "simple", "--empty-cache-freq", "2", "--disable-validation",
          "--max-update", "1000"]


@pytest.fixture(scope="module")
def epochs(corpus, tmp_path_factory):
    return tiny_model_scenario(corpus, tmp_path_factory, "epochs", EPOCHS)


@pytest.mark.slow
def test_batch_size_update_freq_per_epoch_and_max_epoch_as_stock(epochs):
    ours, stock = updates(epochs.fsdp2), updates(epochs.stock)
    assert sorted(ours) == list(range(1, 17))  # 8 + 4 + 4: the update-freq of each epoch
    assert_same_training(ours, stock)
    for out in (epochs.fsdp2, epochs.stock):
        assert "end of epoch 3 (average epoch stats below)" in out
        assert "end of epoch 4" not in out


@pytest.mark.slow
def test_keep_interval_updates_keeps_the_same_files_as_stock(epochs):
    kept = checkpoint_files(epochs.save_dir("fsdp2"))
    assert kept == checkpoint_files(epochs.save_dir("stock"))
    assert {"checkpoint_3_15.pt", "checkpoint_2_9.pt"} <= kept  # the 2 newest interval saves
    assert "checkpoint_1_6.pt" not in kept and "checkpoint3.pt" in kept


@pytest.mark.slow
def test_log_format_simple_prints_every_update_and_empty_cache_freq_is_accepted(epochs):
    """--log-format simple: its per-update lines carry what the json lines carry (parsed by
    ``updates``). --empty-cache-freq 2 is on both runs' command lines, which make the same
    updates (test_batch_size_update_freq_per_epoch_and_max_epoch_as_stock); but fairseq empties
    the CUDA cache only on a GPU, so on CPU nothing shows it being emptied: accepted, not
    exercised."""
    assert len(updates(epochs.fsdp2)) == 16 and '| train_inner | {"' not in epochs.fsdp2
    assert '| train_inner | {"' not in epochs.stock and updates(epochs.stock)


@pytest.fixture(scope="module")
def epochs_killed(epochs):
    """The same command on a save dir holding what a kill right after the end-of-epoch save of
    update 8 leaves (that save as checkpoint_last.pt, its shards beside it: the uninterrupted
    run's checkpoint1.pt, which the same command wrote at the same point, bit for bit what the
    killed run's own save held; a run killed in update 9 made it before, 8 updates and 3 saves
    on 2 ranks more), killed at a chosen point, then rerun:
    - killed in update 12, the last update of epoch 2: it resumed at the start of epoch 2
      (where stock fairseq regroups the batches);
    - the rerun resumes from update 9, in the middle of epoch 2, crosses into epoch 3 and
      finishes."""
    save, uninterrupted = epochs.save_dir("killed"), epochs.save_dir("fsdp2")
    epoch_end = uninterrupted / "checkpoint1.pt"
    assert torch.load(epoch_end, weights_only=True)["optimizer_history"][-1]["num_updates"] == 8
    shards = torch.load(epoch_end, weights_only=True)["fsdp2"]["shards"]
    shutil.copytree(uninterrupted / shards, save / shards)
    shutil.copy(epoch_end, save / "checkpoint_last.pt")
    runs = []
    for fault in ("forward:12:all", None):
        result = epochs.run("killed", fault=fault)
        runs.append((fault, result if fault is None else result[0].output))
    return runs


@pytest.mark.slow
def test_resume_is_exact_mid_epoch_at_epoch_end_and_after_the_last_update(epochs,
                                                                          epochs_killed):
    """fairseq resumed at an epoch end regroups sentences into other batches (platform notes);
    the plugin builds the iterator as the uninterrupted run did (resume.py)."""
    uninterrupted = updates(epochs.fsdp2)
    expect_start = {"forward:12:all": 9, None: 10}
    expect_last = {"forward:12:all": 11, None: 16}  # killed in the next
    for fault, output in epochs_killed:
        assert resumed_at(output) == expect_start[fault] - 1, (fault, output[-2000:])
        assert_resumed_exactly(updates(output), uninterrupted, expect_start[fault],
                               expect_last[fault])
    assert max(uninterrupted) == 16


# --- Adafactor (factored second moments of sharded parameters), --checkpoint-suffix -------------
# --scale-parameter scales each step by the parameter's RMS (a global norm of the shards),
# --beta1 adds a first moment; a save every 2 updates, resumed from update 2; every file name
# carries the suffix, the consolidated export's too. 4 updates: Adafactor's second-moment decay
# 1 - step^-0.8 is 0 at step 1 (the state is the first gradient's alone), so the save after
# update 2 is the first whose state mixes updates; the resumed run's first update reads it all
# (row and column means, first moment, step), its second reads what the resumed run wrote.
SUFFIX = "-af"
ADAFACTOR = ["--optimizer", "adafactor", "--lr", "0.03", "--scale-parameter", "--beta1", "0.9",
             "--max-tokens", "500", "--log-format", "json", "--disable-validation",
             "--max-update", "4", "--save-interval-updates", "2", "--no-epoch-checkpoints",
             f"--checkpoint-suffix={SUFFIX}"]


@pytest.fixture(scope="module")
def adafactor(corpus, tmp_path_factory):
    return tiny_model_scenario(corpus, tmp_path_factory, "adafactor", ADAFACTOR)


def saved_state_keys(checkpoint: Path) -> set[str]:
    """The names of the tensors the shards of an FSDP2 checkpoint file hold."""
    import torch.distributed.checkpoint as dcp
    shards = torch.load(checkpoint, weights_only=True)["fsdp2"]["shards"]
    return set(dcp.FileSystemReader(str(checkpoint.parent / shards)).read_metadata()
               .state_dict_metadata)


@pytest.mark.slow
def test_adafactor_and_checkpoint_suffix_as_stock_and_resumed_from_own_or_stock_checkpoint(
        adafactor):
    """fairseq's Adafactor keeps row and column means of each matrix's squared gradient
    (factored_state.py shards them): the same updates as stock; resumed from its own save
    (DCP), every update as the uninterrupted run's; from stock fairseq's save (its full
    statistics cut into shards), the stock run's updates. With --checkpoint-suffix: the same
    files as stock, and the consolidated export of checkpoint_last<suffix>.pt."""
    ours, stock = updates(adafactor.fsdp2), updates(adafactor.stock)
    assert sorted(ours) == list(range(1, 5))
    assert_same_training(ours, stock)
    save = adafactor.save_dir("fsdp2")
    assert checkpoint_files(save) == checkpoint_files(adafactor.save_dir("stock")) == \
        {f"checkpoint_1_2{SUFFIX}.pt", f"checkpoint_1_4{SUFFIX}.pt", f"checkpoint_last{SUFFIX}.pt"}
    exported = torch.load(save / f"checkpoint_last{SUFFIX}_consolidated.pt", weights_only=True)
    stock_last = adafactor.save_dir("stock") / f"checkpoint_last{SUFFIX}.pt"
    assert exported["model"].keys() == torch.load(stock_last, weights_only=True)["model"].keys()
    keys = saved_state_keys(save / f"checkpoint_last{SUFFIX}.pt")
    row = "optim.state.encoder.layers.0.fc1.weight.exp_avg_sq_row"
    assert {row, row[:-3] + "col"} <= keys and row[:-4] not in keys, sorted(keys)[:20]
    # fairseq adds the suffix to --restore-file too: checkpoint_1_2.pt names checkpoint_1_2-af.pt
    own = save / "checkpoint_1_2.pt"
    assert_resumed_exactly(updates(adafactor.run("resumed", "--restore-file", own, "--no-save")),
                           ours, 3)
    made = updates(adafactor.run("from-stock", "--restore-file",
                                 adafactor.save_dir("stock") / "checkpoint_1_2.pt", "--no-save",
                                 backend="fsdp2"))
    assert sorted(made) == [3, 4]
    assert_same_training(made, {n: stock[n] for n in made})


# --- the NLLB task: translation_multi_simple_epoch, temperature sampling, virtual epochs -------------
PAIRS = [("eng_Latn", "fra_Latn"), ("eng_Latn", "deu_Latn")]
#: transformer_nllb_tiny (fairseq_fsdp2/models/nllb.py) in stock flags, for stock fairseq's run
#: without the plugin; written out here, so a wrong default there shows as other losses
STOCK_NLLB_TINY = [
    "--arch", "transformer", "--share-all-embeddings", "--encoder-normalize-before",
    "--decoder-normalize-before", "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "64", "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
    "--decoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4",
    "--decoder-attention-heads", "4", "--max-source-positions", "512",
    "--max-target-positions", "512", "--activation-dropout", "0"]


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory):
    """Two pairs of the numbers corpus (300 sentences each), without dropout (also
    transformer_nllb_tiny's attention dropout 0.1, in both runs; that default is checked in
    tests/test_nllb_archs.py): the resume on 1 rank x --update-freq 2 draws its second
    micro-batch's masks from the first's stream, where each of 2 ranks starts its own (module
    docstring). Virtual epochs of 300 sampled sentences (6 updates at 2 ranks: epoch 1 is
    updates 1-6); a save every 3 updates, so update 9 is mid virtual epoch 2 (the resumed runs
    start there)."""
    root = tmp_path_factory.mktemp("multilingual")
    numbers.write_corpus(root / "raw", PAIRS, n_train=300, n_valid=10, n_test=10, seed=2)
    data = prepare(root / "raw", root / "data", vocab_size=120, log=lambda *a: None)

    def args(save):
        return [data, "--user-dir", PLUGIN, "--task", "translation_multi_simple_epoch",
                "--arch", "transformer_nllb_tiny", "--lang-pairs",
                ",".join(f"{s}-{t}" for s, t in PAIRS),
                "--langs", (data / "langs.txt").read_text().strip(),
                "--encoder-langtok", "src", "--decoder-langtok", "--lang-tok-style",
                "multilingual", "--sampling-method", "temperature", "--sampling-temperature", 5,
                "--virtual-epoch-size", 300, "--dropout", 0, "--attention-dropout", 0, *BASE,
                "--max-tokens", 600, "--log-format", "json", "--disable-validation", "--max-update", 10,
                "--save-interval-updates", 3, "--save-dir", save]
    return Scenario(root, args, "multilingual", stock_model=STOCK_NLLB_TINY)


@pytest.mark.slow
def test_multilingual_temperature_sampling_virtual_epochs_as_stock(multilingual):
    ours = updates(multilingual.fsdp2)
    assert sorted(ours) == list(range(1, 11))
    assert_same_training(ours, updates(multilingual.stock))
    assert "begin training epoch 2" in multilingual.fsdp2  # more than one virtual epoch


def mid_virtual_epoch(save: Path) -> tuple[Path, int]:
    """The newest save inside a virtual epoch after the first, and its update."""
    found = []
    for path in save.iterdir():
        if not re.fullmatch(r"checkpoint_\d+_\d+\.pt", path.name):
            continue
        state = torch.load(path, weights_only=True)
        if state["extra_state"]["train_iterator"]["iterations_in_epoch"] > 0 and \
                state["extra_state"]["train_iterator"]["epoch"] >= 2:
            found.append((state["optimizer_history"][-1]["num_updates"], path))
    assert found, sorted(p.name for p in save.iterdir())
    update, path = max(found)
    return path, update


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 1])
def test_multilingual_resumed_mid_virtual_epoch(multilingual, ranks):
    """Resumed (--restore-file, the file a kill after that save leaves) in the middle of a
    later virtual epoch: the sampled, re-batched epoch continues where it stood."""
    uninterrupted = updates(multilingual.fsdp2)
    path, start = mid_virtual_epoch(multilingual.save_dir("fsdp2"))
    out = multilingual.run(f"resumed{ranks}", "--restore-file", path,
                           "--update-freq", 3 - ranks, "--no-save", ranks=ranks, backend="fsdp2")
    made = updates(out)
    assert sorted(made) == list(range(start + 1, 11))
    if ranks == 2:
        assert_resumed_exactly(made, uninterrupted, start + 1)
    else:
        assert_same_training(made, {n: uninterrupted[n] for n in made})


# --- layerdrop on several ranks -------------------------------------------------------------------
# 2+2 layers, p = 0.5 each, 2 ranks x --update-freq 2, 6 updates, a save every 3; the same command
# resumed from update 3. Every update of both runs is watched on every rank by
# tests/probes/layerdrop_probe.py (the layers run, the units gathered and reduce-scattered, the
# layers left without a gradient). Not compared with legacy_ddp, whose ranks skip other layers.
LAYERDROP = ["--encoder-layerdrop", "0.5", "--decoder-layerdrop", "0.5", "--update-freq", "2",
             "--max-tokens", "500", "--log-format", "json", "--disable-validation",
             "--max-update", "6", "--save-interval-updates", "3"]
LAYER_LISTS = {"encoder.layers": 2, "decoder.layers": 2}  # TINY_MODEL's


@pytest.fixture(scope="module")
def layerdrop(corpus, tmp_path_factory):
    """(rank 0's output, {rank: {update: probe report}}) of the run and of its resumed run."""
    root = tmp_path_factory.mktemp("layerdrop")

    def run(name: str, *extra) -> tuple[str, dict]:
        args = [corpus, "--user-dir", PLUGIN, *TINY_MODEL, *BASE, *FSDP2, *LAYERDROP,
                "--save-dir", root / name, *extra]
        results = run_ranks(2, lambda rank: [str(a) for a in args], module="layerdrop_probe",
                            env={"PYTHONPATH": PROBES}, timeout=300)
        reports: dict = {}
        for r in results:
            assert r.returncode == 0, r.output[-3000:]
            for line in r.output.splitlines():
                if line.startswith("LAYERS "):
                    report = json.loads(line[len("LAYERS "):])
                    reports.setdefault(report["rank"], {})[report["update"]] = report
        return results[0].output, reports
    full = run("full", "--fsdp2-no-consolidate")  # no export: none is read
    return full, run("resumed", "--restore-file", root / "full" / "checkpoint_1_3.pt",
                     "--no-save")


def test_layerdrop_every_rank_skips_the_same_layers_and_gathers_none_of_them(layerdrop):
    """Each update, both ranks and both micro-batches skip the layers that seed and update
    decide (sharding/layerdrop.py's dropped_layers, --seed 1); a skipped layer unit is gathered
    and reduce-scattered on no rank and gets no gradient; the number skipped is logged."""
    from fairseq_fsdp2.sharding.layerdrop import dropped_layers
    (output, reports), _ = layerdrop
    logged = {int(r["num_updates"]): r for r in train_inner(output)}
    assert sorted(reports) == [0, 1] and sorted(reports[0]) == sorted(reports[1]) == \
        list(range(1, 7)) == sorted(logged)
    skipped_any = kept_any = all_graded = False
    for n in range(1, 7):
        skipped = set()
        for name, count in LAYER_LISTS.items():
            mine = dropped_layers(1, n - 1, name, count, 0.5)
            assert logged[n][f"{name.split('.')[0]}_layers_dropped"] == str(len(mine)), n
            skipped |= {f"{name}.{i}" for i in mine}
        kept = {f"{name}.{i}" for name, count in LAYER_LISTS.items()
                for i in range(count)} - skipped
        skipped_any, kept_any = skipped_any or bool(skipped), kept_any or bool(kept)
        a, b = reports[0][n], reports[1][n]
        for key in ("ran", "gathered", "reduced", "no_grad"):
            assert a[key] == b[key], (n, key, a, b)  # the ranks' collectives pair up
        assert a["ran"] == {layer: 2 for layer in sorted(kept)}, (n, a)  # both micro-batches
        assert not skipped & set(a["gathered"]) and not skipped & set(a["reduced"]), (n, a)
        assert kept <= set(a["gathered"]), (n, a)  # the probe sees the units it reports on
        # the skipped layers hold no gradient; while a decoder layer runs (the encoder's only
        # way into the loss) every layer that ran holds one, so the probe's list is not every
        # layer whatever happened (with every decoder layer skipped the encoder's layers get
        # none either)
        assert skipped <= set(a["no_grad"]), (n, a)
        if any(layer.startswith("decoder.") for layer in kept):
            assert set(a["no_grad"]) == skipped, (n, a)
            all_graded = True
    assert skipped_any and kept_any and all_graded  # the seed's draws exercise every case


def test_layerdrop_resumed_run_is_exact(layerdrop):
    """Resumed from update 3 at the same world size: every update skips the same layers and
    prints the same loss and gradient norm as the uninterrupted run, bit for bit."""
    (full_output, full), (output, resumed) = layerdrop
    made, uninterrupted = updates(output), updates(full_output)
    assert_resumed_exactly(made, uninterrupted, 4)
    assert sorted(made) == [4, 5, 6]
    for rank in (0, 1):
        assert sorted(resumed[rank]) == [4, 5, 6]
        for n in (4, 5, 6):
            assert resumed[rank][n] == full[rank][n], (rank, n)


# --- features refused ------------------------------------------------------------------------------
# tests/test_bad_input.py (docs/errors.md). --store-ema: tests/test_ema.py.


# --- the documented table ------------------------------------------------------------------------------

def documented_matrix() -> list[tuple[str, str, str]]:
    """(feature, status, tests) rows of docs/compatibility.md's "fairseq features under FSDP2"
    table."""
    text = (REPO / "docs" / "compatibility.md").read_text()
    section = text.split("\n## fairseq features under FSDP2\n", 1)[1]
    table = section[section.index("\n| "):].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]  # no header
    return [tuple(cell.strip() for cell in row.strip("|").split(" | ")) for row in rows]


def test_compatibility_table_names_existing_tests_and_every_test_has_a_row():
    rows = documented_matrix()
    assert rows, "docs/compatibility.md has no fairseq features table"
    named = set()
    for feature, status, tests in rows:
        for ref in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", tests):
            path, name = ref
            assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), \
                f"row {feature!r} names {path}::{name}, which does not exist"
            named.add((path, name))
        assert re.search(r"`tests/", tests), f"row {feature!r} names no test"
    for path in ("tests/test_fairseq_compat.py", "tests/test_fairseq_validation.py"):
        mine = set(re.findall(r"^def (test_\w+)\(", (REPO / path).read_text(), re.M))
        mine.discard("test_compatibility_table_names_existing_tests_and_every_test_has_a_row")
        missing = mine - {name for where, name in named if where == path}
        assert not missing, f"{path}: tests with no row in docs/compatibility.md: {sorted(missing)}"
