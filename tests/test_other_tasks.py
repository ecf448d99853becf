"""fairseq's tasks that call parts of the model on their own (outside the root's forward) under
FSDP2, and a user's own --user-dir with the plugin: the rows of docs/compatibility.md ("fairseq
tasks and model families") that name the tests below.

- ``multilingual_translation`` (``FairseqMultiModel``: the task calls ``model.models[pair]``)
  with encoders and decoders shared by both pairs, the encoders' embedding and layer norms in
  the root unit (so a call that did not gather the root would fail or train otherwise);
- ``translation_moe`` (fairseq's examples user dir: the task calls ``model.encoder``,
  ``model.decoder`` and ``model.gating_network`` itself), through ``python -m
  fairseq_fsdp2.train``, since fairseq takes one ``--user-dir``.

Each runs with the plugin's ``--ddp-backend fsdp2`` on 2 ranks and with stock fairseq's
``legacy_ddp`` (without the plugin: translation_moe's on 2 ranks, multilingual's on 1 rank x
--update-freq 2, the same batches: ``multilingual``); per-update loss and gnorm are compared within
tests/numerics.py's FP32_REORDERED plus fairseq's printed rounding (``assert_same_training``, the
bound tests/test_fairseq_compat.py derives for fsdp2 vs legacy_ddp: only the order of the
gradient sums differs). A run resumed from its own mid-run checkpoint prints exactly the
uninterrupted run's values, and stock fairseq-generate (no plugin) reads the consolidated
export. A user directory of the test's own (tests/fixtures/user_dir: a task and a model) trains
through ``python -m fairseq_fsdp2.train`` and through the hydra entry with
``common.user_dir``.
"""
from __future__ import annotations

import re

import pytest
import torch

from conftest import PLUGIN, REPO, SHORT_GENERATION, stock_ddp
from launcher import ok, run_command, run_ranks
from scenarios import BASE, FSDP2, Scenario, assert_resumed_exactly, assert_same_training, updates

USER_DIR = REPO / "tests" / "fixtures" / "user_dir"
DIMS = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
        "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
        "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--dropout", "0.1"]
PAIRS = "src-tgt,tgt-src"
#: what the fixture's task and model log (tests/fixtures/user_dir/__init__.py; not imported
#: here: its registrations belong to the processes that load it as a user dir)
TASK_LINE = "echo_translation: the user's task is set up"
MODEL_LINE = "echo_transformer: the user's model is built"
ENTRY_LINE = "called on their own outside the root's forward (then gathered with the root unit): "
#: the worktree's package before any installed copy (the hydra run changes directory)
ENV = {"PYTHONPATH": str(REPO)}


def assert_translated(proc) -> None:
    """fairseq-generate exited 0 and printed a hypothesis for each sentence it says it
    translated, most of the 100 valid sentences (multilingual_translation leaves out 4 of them
    with stock weights too: its own filtering) and a BLEU line."""
    assert proc.returncode == 0, proc.output[-3000:]
    hypotheses = [line for line in proc.output.splitlines() if line.startswith("H-")]
    said = int(re.search(r"Translated (\d+) sentences", proc.output).group(1))
    assert len(hypotheses) == said > 90 and "BLEU" in proc.output, proc.output[-2000:]


# --- multilingual_translation, shared encoders and decoders -------------------------------------
@pytest.fixture(scope="module")
def multilingual(corpus, tmp_path_factory):
    """Both directions of the tiny corpus, one encoder and one decoder shared by the pairs; a
    save at update 2 (and at the end), from which the resumed run makes the last 2 of the 4.
    The stock run is on 1 rank x --update-freq 2 (one process fewer): the 2-rank run's global
    batches in the same updates, summed over micro-batches where 2 ranks sum over ranks, which
    only reorders the gradient sums, as fsdp2 vs legacy_ddp do (within assert_same_training's
    bound). Hence no dropout: fairseq seeds dropout once per update (seed + update number), so
    each of 2 ranks starts its batch from that seed, where 1 rank's second micro-batch goes on
    from the first's draws (with dropout 0.1: other losses)."""
    def args(save):
        return [corpus, "--user-dir", PLUGIN, "--task", "multilingual_translation", "--arch",
                "multilingual_transformer", "--lang-pairs", PAIRS, "--share-encoders",
                "--share-decoders", "--share-decoder-input-output-embed",
                "--encoder-normalize-before", "--decoder-normalize-before", *DIMS,
                "--dropout", "0", *BASE, "--max-tokens", "500", "--log-format", "json",
                "--disable-validation", "--max-update", "4", "--save-interval-updates", "2",
                "--no-epoch-checkpoints", "--save-dir", save]
    return Scenario(tmp_path_factory.mktemp("multilingual"), args, "multilingual",
                    stock_ranks=1, stock_extra=("--update-freq", 2))


@pytest.mark.slow
def test_multilingual_shared_encoders_and_decoders_train_as_stock(multilingual):
    ours = updates(multilingual.fsdp2)
    assert sorted(ours) == list(range(1, 5))
    assert_same_training(ours, updates(multilingual.stock))
    assert ENTRY_LINE + "models.src-tgt, models.tgt-src" in multilingual.fsdp2
    # the shared encoder's embedding and layer norm are the root's: its calls gather them
    root = next(l for l in multilingual.fsdp2.splitlines() if l.startswith("root "))
    assert root.split()[3] != "0", root


@pytest.mark.slow
def test_multilingual_resumes_exactly_and_stock_generate_reads_the_export(multilingual, corpus):
    save = multilingual.save_dir("fsdp2")
    out = multilingual.run("resumed", "--restore-file", save / "checkpoint_1_2.pt", "--no-save")
    assert_resumed_exactly(updates(out), updates(multilingual.fsdp2), 3)
    export = save / "checkpoint_last_consolidated.pt"
    stock = torch.load(multilingual.save_dir("stock") / "checkpoint_last.pt", weights_only=False)
    assert torch.load(export, weights_only=True)["model"].keys() == stock["model"].keys()
    proc = run_command("fairseq_cli.generate", corpus, "--path", export, "--task",
                       "multilingual_translation", "--lang-pairs", PAIRS, "--source-lang", "src",
                       "--target-lang", "tgt", "--gen-subset", "valid", "--beam", "2",
                       "--max-tokens", "2000", "--cpu", *SHORT_GENERATION)
    assert_translated(proc)


# --- translation_moe (fairseq's examples user dir) ----------------------------------------------
MOE_DIR = "examples/translation_moe/translation_moe_src"  # fairseq resolves it in its package
MOE_TASK = ["--user-dir", MOE_DIR, "--task", "translation_moe", "--method", "hMoElp",
            "--mean-pool-gating-network", "--num-experts", "3"]
MOE = [*MOE_TASK, "--arch", "transformer", "--share-all-embeddings"]


@pytest.fixture(scope="module")
def moe(corpus, tmp_path_factory):
    """The fsdp2 run and stock's; nothing reads stock's checkpoints: it saves none (and so
    shows that the fsdp2 run's saves do not change what it trains)."""
    root = tmp_path_factory.mktemp("moe")

    def run(label, *extra, stock=False):
        def argv(rank):
            return [corpus, *MOE, *DIMS, *BASE, "--max-tokens", "500", "--log-format", "json",
                    "--disable-validation", "--max-update", "4", "--save-interval-updates", "2",
                    "--no-epoch-checkpoints", "--save-dir", root / label,
                    *(stock_ddp(rank, 2) + ["--no-save"] if stock else FSDP2), *extra]
        return ok(run_ranks(2, argv, timeout=300, env=ENV,
                            module="fairseq_cli.train" if stock else "fairseq_fsdp2.train"))
    return root, run, run("fsdp2"), run("stock", stock=True)


@pytest.mark.slow
def test_translation_moe_trains_as_stock_resumes_exactly_and_stock_generate_reads_it(moe,
                                                                                      corpus):
    root, run, ours, stock = moe
    assert sorted(updates(ours)) == [1, 2, 3, 4]
    assert_same_training(updates(ours), updates(stock))
    assert ENTRY_LINE + "encoder, decoder, gating_network" in ours
    resumed = run("resumed", "--restore-file", root / "fsdp2" / "checkpoint_1_2.pt", "--no-save")
    assert_resumed_exactly(updates(resumed), updates(ours), 3)
    proc = run_command("fairseq_cli.generate", corpus, "--path",
                       root / "fsdp2" / "checkpoint_last_consolidated.pt", *MOE_TASK,
                       "--gen-expert", "0", "--gen-subset", "valid", "--beam", "2",
                       "--max-tokens", "2000", "--cpu", *SHORT_GENERATION)
    assert_translated(proc)


# --- a user's own --user-dir with the plugin ------------------------------------------------------
USER_FLAGS = ["--task", "echo_translation", "--arch", "echo_transformer_tiny", "--criterion",
              "cross_entropy", "--optimizer", "adam", "--lr", "0.001", "--lr-scheduler", "fixed",
              "--max-tokens", "500", "--num-workers", "0", "--log-format", "json",
              "--log-interval", "1", "--seed", "1", "--cpu", "--no-progress-bar",
              "--disable-validation", "--max-update", "3", "--no-save"]
HYDRA_CONFIG = """\
hydra: {{run: {{dir: .}}, output_subdir: null}}
common: {{cpu: true, log_format: json, log_interval: 1, seed: 1, user_dir: {user_dir}}}
checkpoint: {{no_save: true}}
task: {{_name: echo_translation, data: {data}}}
dataset: {{max_tokens: 500, num_workers: 0, disable_validation: true}}
criterion: {{_name: cross_entropy}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: fixed}}
optimization: {{lr: [0.001], max_update: 3}}
distributed_training: {{ddp_backend: fsdp2}}
model: {{_name: echo_transformer_tiny, min_params_to_wrap: 1}}
"""


def test_a_users_own_user_dir_trains_with_the_plugin_from_the_command_line_and_hydra(
        corpus, tmp_path, monkeypatch):
    """The user's task and model (tests/fixtures/user_dir) under FSDP2 through ``python -m
    fairseq_fsdp2.train --user-dir`` and the hydra entry's ``common.user_dir``, one rank each:
    the same updates as stock fairseq-train with that user dir (one process: the same sums in
    the same order, so the same printed values)."""
    user = [corpus, "--user-dir", USER_DIR, *USER_FLAGS]
    (cli,) = run_ranks(1, lambda r: [*user, *FSDP2], module="fairseq_fsdp2.train", env=ENV)
    (stock,) = run_ranks(1, lambda r: user, torchrun_env=False)
    (tmp_path / "user.yaml").write_text(HYDRA_CONFIG.format(user_dir=USER_DIR, data=corpus))
    monkeypatch.chdir(tmp_path)
    (hydra,) = run_ranks(1, lambda r: ["--config-dir", tmp_path, "--config-name", "user"],
                         module="fairseq_fsdp2.hydra_train", env=ENV)
    # hydra logs "[time][train_inner][INFO] - {...}": in fairseq-train's layout for `updates`
    hydra.output = re.sub(r"\]\[(train_inner|train)\]\[INFO\] - ", r" | \1 | ", hydra.output)
    for result in (cli, stock, hydra):
        assert result.returncode == 0, result.output[-3000:]
        assert TASK_LINE in result.output and MODEL_LINE in result.output
        assert sorted(updates(result.output)) == [1, 2, 3], result.output[-3000:]
    for result in (cli, hydra):
        assert "FSDP2 sharding plan: 6 units" in result.output
        assert_same_training(updates(result.output), updates(stock.output))
    assert updates(hydra.output) == updates(cli.output)  # one path: the same sums
    assert "FSDP2 sharding plan" not in stock.output
