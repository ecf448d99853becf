"""The bad input catalogue: every row of the bad-input table in docs/errors.md, run for real.

Each case stops before training with exactly one ``fairseq_fsdp2: error: ...`` line holding the
documented text, no traceback, a non-zero exit, and nothing written: the --save-dir it names
does not appear, the files it reads are unchanged.
"""
import datetime
import json
import os
import re
import shutil
import subprocess

import pytest
import torch

import fairseq_fsdp2  # noqa: F401  (allow-lists the classes fairseq pickles for torch.load)

from conftest import PLUGIN, REPO, TINY_MODEL, TRAINING, tmpfs
from launcher import run_ranks
from scenarios import FSDP2

from fairseq_fsdp2.checkpoint.export import consolidate
from fairseq_fsdp2.command_line import before_torchrun

PROBES = str(REPO / "tests" / "probes")
HYDRA = "fairseq_fsdp2.hydra_train"


def catalogue_rows() -> list[str]:
    """The first column of the bad-input table in docs/errors.md."""
    text = (REPO / "docs" / "errors.md").read_text()
    section = text.split("\n## Bad input\n", 1)[1]
    table = section[section.index("\n| "):].split("\n\n", 1)[0]  # the first table
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    return [line.split(" | ")[0][2:].strip() for line in rows[1:]]  # skip the header


@pytest.fixture(scope="module")
def files(corpus, tmp_path_factory):
    """Inputs the cases read: a real sharded checkpoint (1 rank, 1 update) and broken files."""
    root = tmp_path_factory.mktemp("inputs")
    save = root / "saved"
    # 1 update: 1 batch into the epoch, which 2 ranks do not divide (the mid-epoch row); no
    # consolidated copy at the end: no row reads one (stock.pt and hf are consolidated below)
    results = run_ranks(1, lambda r: [corpus, "--user-dir", PLUGIN, *TINY_MODEL, *TRAINING,
                                      *FSDP2, "--max-update", "1", "--save-dir", save,
                                      "--fsdp2-no-consolidate"])
    assert results[0].returncode == 0, results[0].output[-3000:]
    good = save / "checkpoint_last.pt"
    lora_save = root / "lora"  # a LoRA checkpoint (1 update)
    results = run_ranks(1, lambda r: [corpus, "--user-dir", PLUGIN, *TINY_MODEL, *TRAINING,
                                      *FSDP2, "--max-update", "1", "--save-dir", lora_save,
                                      "--lora-rank", "4", "--fsdp2-no-consolidate"])
    assert results[0].returncode == 0, results[0].output[-3000:]
    shards = save / torch.load(good, weights_only=True)["fsdp2"]["shards"]
    missing_shard = root / "missing-shard"
    missing_shard.mkdir()
    (missing_shard / "checkpoint_last.pt").write_bytes(good.read_bytes())
    (missing_shard / "fsdp2_shards").mkdir()
    (missing_shard / shards.relative_to(save)).mkdir()
    (missing_shard / shards.relative_to(save) / ".metadata").write_bytes(
        (shards / ".metadata").read_bytes())
    short_shard = root / "short-shard"
    shutil.copytree(save, short_shard)
    shard = short_shard / shards.relative_to(save) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    text = root / "notes.pt"
    text.write_text("not a checkpoint\n")
    truncated = root / "truncated.pt"
    torch.save({"model": {"w": torch.zeros(1000)}}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:600])
    stranger = root / "stranger.pt"
    torch.save({"model": {}, "when": datetime.date(2026, 11, 30)}, stranger)
    plain_file = root / "plain-file"
    plain_file.write_text("")
    stock_file = consolidate(str(good), str(root / "stock.pt"))  # the good checkpoint, stock
    hf = root / "hf"  # the good checkpoint in the Hugging Face format, and one of another kind
    consolidate(stock_file, str(hf), out_format="hf")  # from stock.pt: its shards read once
    bart = root / "hf-bart"
    shutil.copytree(hf, bart)
    config = json.loads((bart / "config.json").read_text())
    (bart / "config.json").write_text(json.dumps(
        {**config, "model_type": "bart", "architectures": ["BartForConditionalGeneration"]}))
    (root / "no-model").mkdir()
    # the good checkpoint as a stock file with 3 embedding rows more than the data's dictionary
    # has entries, and with 3 fewer, beside a dictionary.txt of its own in another order
    stock = torch.load(stock_file, weights_only=True)
    weight = stock["model"]["encoder.embed_tokens.weight"]
    wider, narrow = root / "wider.pt", root / "narrow" / "checkpoint.pt"
    for path, rows in ((wider, torch.cat([weight, weight[:3]])), (narrow, weight[:-3])):
        path.parent.mkdir(exist_ok=True)
        torch.save({**stock, "model": {**stock["model"], **{
            k: rows for k in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                              "decoder.output_projection.weight")}}}, path)
    lines = (corpus / "dict.src.txt").read_text().splitlines()
    lines[0], lines[1] = lines[1], lines[0]
    (narrow.parent / "dict.txt").write_text("\n".join(lines) + "\n")
    return {"good": good, "missing_shard": missing_shard / "checkpoint_last.pt",
            "shard_dir": missing_shard / shards.relative_to(save), "text": text,
            "truncated": truncated, "stranger": stranger, "absent": root / "absent.pt",
            "hf": hf, "hf_bart": bart, "no_model": root / "no-model",
            "plain_file": plain_file, "corpus": corpus,
            "short_shard": short_shard / "checkpoint_last.pt", "short_shard_file": shard,
            "wider": wider, "narrow": narrow, "narrow_dict": narrow.parent / "dict.txt",
            "lora": lora_save / "checkpoint_last.pt"}


STEP_IN_BACKWARD_CLIPS = ("--fsdp2-step-in-backward needs --clip-norm 0, got 1: clipping scales "
                          "every gradient by the whole model's norm, known only after backward")

# docs/errors.md row -> cases: (ranks (0: one process, not under torchrun), extra flags (may name
# files), message[, module])
CATALOGUE = {
    "`--min-params-to-wrap -5`": [
        (1, ["--min-params-to-wrap", "-5"], "--min-params-to-wrap must be >= 0, got -5")],
    "`--fsdp2-replicate-degree 3` on 2 ranks": [
        (2, ["--fsdp2-replicate-degree", "3"],
         "--fsdp2-replicate-degree 3 does not divide the world size 2")],
    "`--fsdp2-reshard-degree 3` on 2 ranks": [
        (2, ["--fsdp2-reshard-degree", "3"], "--fsdp2-reshard-degree 3 must divide the shard "
                                             "group size 2 (world size 2 / replicate degree 1) "
                                             "and be neither 1 nor 2")],
    "`--fsdp2-reshard-degree` with `--no-reshard-after-forward`": [
        (1, ["--fsdp2-reshard-degree", "2", "--no-reshard-after-forward"],
         "--fsdp2-reshard-degree and --no-reshard-after-forward conflict: choose one")],
    "`--fp16` with `--bf16`": [
        (1, ["--fp16", "--bf16"], "--fp16 and --bf16 are mutually exclusive: choose one")],
    "`--amp`": [
        (1, ["--amp"], "--amp cannot be combined with --ddp-backend fsdp2: use --fp16 or --bf16 "
                       "(FSDP2 mixed precision: fp32 master weights, fp16/bf16 compute)")],
    "`--tpu`, `--use-bmuf`, `--zero-sharding os`, `--model-parallel-size 2` with fsdp2": [
        (1, [flag, *value], f"{name} cannot be combined with --ddp-backend fsdp2")
        for flag, value, name in [("--tpu", [], "--tpu"), ("--use-bmuf", [], "--use-bmuf"),
                                  ("--zero-sharding", ["os"], "--zero-sharding"),
                                  ("--model-parallel-size", ["2"], "--model-parallel-size > 1")]],
    "`--fsdp2-reduce-dtype fp16` without `--fp16`, or `bf16` without `--bf16`": [
        (1, [*precision, "--fsdp2-reduce-dtype", reduce],
         f"--fsdp2-reduce-dtype {reduce} needs {needs}: gradients are reduced in fp32 or in the "
         f"compute dtype, here {compute}")
        for precision, reduce, needs, compute in [
            ([], "fp16", "--fp16 (or --memory-efficient-fp16)", "fp32"),
            (["--bf16"], "fp16", "--fp16 (or --memory-efficient-fp16)", "bf16"),
            (["--fp16"], "bf16", "--bf16", "fp16")]] + [
        (1, ["distributed_training.fsdp2_reduce_dtype=fp16"],  # the same key in hydra
         "--fsdp2-reduce-dtype fp16 needs --fp16 (or --memory-efficient-fp16): gradients are "
         "reduced in fp32 or in the compute dtype, here fp32", HYDRA)],
    "`--fp16-adam-stats` with `--bf16-adam-stats`, or `--bf16-adam-stats` without Adam": [
        (1, ["--bf16", "--bf16-adam-stats", "--fp16-adam-stats"],
         "--bf16-adam-stats and --fp16-adam-stats conflict: choose one"),
        (1, ["--bf16", "--bf16-adam-stats", "--optimizer", "adafactor"],
         "--bf16-adam-stats keeps Adam's moments: it needs --optimizer adam, got --optimizer "
         "adafactor")],
    "`--eight-bit-adam-stats` with `--fp16-adam-stats` or `--bf16-adam-stats`, or without "
    "Adam": [
        (1, ["--eight-bit-adam-stats", "--fp16-adam-stats"],
         "--eight-bit-adam-stats and --fp16-adam-stats conflict: choose one"),
        (1, ["--bf16", "--eight-bit-adam-stats", "--bf16-adam-stats"],
         "--eight-bit-adam-stats and --bf16-adam-stats conflict: choose one"),
        (1, ["--eight-bit-adam-stats", "--optimizer", "adafactor"],
         "--eight-bit-adam-stats keeps Adam's moments: it needs --optimizer adam, got "
         "--optimizer adafactor")],
    "`--bf16-adam-stats`, `--eight-bit-adam-stats` or `--init-new-langs-from` with another "
    "backend (`--ddp-backend legacy_ddp`, ...)": [
        (1, [flag, *value, "--ddp-backend", "legacy_ddp"],
         f"{flag} needs --ddp-backend fsdp2: --ddp-backend legacy_ddp would ignore it")
        for flag, value in [("--bf16-adam-stats", []), ("--eight-bit-adam-stats", []),
                            ("--init-new-langs-from", ["eng_Latn"])]],
    "`--fsdp2-step-in-backward` with clipping (`--clip-norm` above 0), `--update-freq` above 1, "
    "`--fp16`, `--fp16-adam-stats`, `--cpu-offload`, `--lora-train-new-rows` or another "
    "optimizer than Adam": [
        (0, ["--fsdp2-step-in-backward"], STEP_IN_BACKWARD_CLIPS),  # TRAINING clips at 1.0
        (0, ["--fsdp2-step-in-backward", "--clip-norm", "0", "--update-freq", "2"],
         "--fsdp2-step-in-backward needs --update-freq 1, got 2: the gradients of several "
         "micro-batches are summed before the step"),
        (0, ["--fsdp2-step-in-backward", "--clip-norm", "0", "--fp16"],
         "--fsdp2-step-in-backward cannot be combined with --fp16: an update whose loss-scaled "
         "gradients overflow is skipped, known only after backward (use --bf16)"),
        (1, ["distributed_training.fsdp2_step_in_backward=true"], STEP_IN_BACKWARD_CLIPS,
         HYDRA)],  # the demo's config clips at 1.0
    "`--lora-rank -1`, `--lora-alpha 0`, `--lora-dropout 1`, or a LoRA option without "
    "`--lora-rank`": [
        (1, ["--lora-rank", "-1"], "--lora-rank must be >= 0 (0: off), got -1"),
        (1, ["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0, got 0"),
        (1, ["--lora-rank", "4", "--lora-dropout", "1"],
         "--lora-dropout must be >= 0 and < 1, got 1"),
        (1, ["--lora-alpha", "8"], "--lora-alpha needs --lora-rank R > 0 (LoRA is off)"),
        (1, ["--lora-train-params", "layer_norm"],
         "--lora-train-params needs --lora-rank R > 0 (LoRA is off)")],
    "`--lora-modules` naming no linear module of the model, or `--lora-train-params` that is "
    "not a regular expression": [
        (1, ["--lora-rank", "4", "--lora-modules", "q_prj"], "--lora-modules q_prj: no linear "
         "module of the model is named so (its linear modules: fc1, fc2, k_proj, out_proj, "
         "output_projection, q_proj, v_proj)"),
        (1, ["--lora-rank", "4", "--lora-train-params", "("], "--lora-train-params: '(' is not "
         "a regular expression (missing ), unterminated subpattern at position 0)")],
    "`--lora-train-new-rows` with `--weight-decay`": [
        (1, ["--lora-rank", "4", "--lora-train-new-rows", "--weight-decay", "0.01"],
         "--lora-train-new-rows keeps the pretrained rows as they are, which --weight-decay "
         "0.01 would shrink: choose one")],
    "`--lora-rank` with another backend (`--ddp-backend legacy_ddp`, ...)": [
        (1, ["--lora-rank", "4", "--ddp-backend", "legacy_ddp"],
         "--lora-rank needs --ddp-backend fsdp2: --ddp-backend legacy_ddp would ignore it")],
    "`--lora-rank` resuming (`--restore-file`) a checkpoint trained without it, or a LoRA "
    "checkpoint resumed without it": [
        (1, ["--lora-rank", "4", "--restore-file", "{good}"],
         "{good} was not trained with --lora-rank: start LoRA from it with "
         "--finetune-from-model"),
        (1, ["--restore-file", "{lora}"], "{lora} was trained with --lora-rank 4: resume it "
         "with --lora-rank 4, or start from its merged weights with --finetune-from-model")],
    "`--ema-seed-model` that does not exist or holds no EMA": [
        (1, ["--store-ema", "--ema-seed-model", "{absent}"],
         "--ema-seed-model not found: {absent}"),
        (1, ["--store-ema", "--ema-seed-model", "{good}"],
         "--ema-seed-model {good} holds no EMA (extra_state['ema']): was it trained with "
         "--store-ema?")],
    "`--max-tokens 0` or `-5`, `--batch-size 0`, `--update-freq 0` (also `--max-tokens-valid`, "
    "`--batch-size-valid`, `--required-batch-size-multiple`, `--log-interval`, "
    "`--save-interval`, `--validate-interval`, `--max-source-positions`, "
    "`--max-target-positions` below 1)": [
        # one end to end; every flag of the row in-process (NUMBER_CASES, below)
        (1, ["--max-tokens", "0"], "--max-tokens must be >= 1, got 0")],
    "a negative `--max-update`, `--max-epoch`, `--lr`, `--warmup-updates` or `--num-workers`": [
        (1, ["--max-update", "-3"], "--max-update must be >= 0 (0: no limit), got -3"),
        (1, ["--lr", "0.1,-1"], "--lr must be >= 0, got 0.1,-1")],
    "`--dropout`, `--attention-dropout` or `--activation-dropout` outside 0 to 1": [
        (1, ["--dropout", "1.5"], "--dropout must be between 0 and 1, got 1.5")],
    "a value of one of the plugin's flags out of its choices (`--fsdp2-root-reshard sometimes`, "
    "with any backend), and in an FSDP2 run any flag's (`--optimizer adamm`) or an unknown "
    "flag": [
        (1, ["--fsdp2-root-reshard", "sometimes", *backend], "argument --fsdp2-root-reshard: "
         "invalid choice: 'sometimes' (choose from 'default', 'always')")
        for backend in ([], ["--ddp-backend", "legacy_ddp"])] + [
        (1, ["--optimizer", "adamm"], "argument --optimizer: invalid choice: 'adamm' (choose "
                                      "from 'adadelta', "),
        (1, ["--fsdp2-root-reshrd", "always"], "unrecognized arguments: --fsdp2-root-reshrd "
                                               "always")],
    "`--distributed-world-size 2` in one process (no torchrun) on CPU": [
        (0, ["--distributed-world-size", "2"], "--distributed-world-size 2 needs one process per "
                                                "rank and there is CPU (--cpu or no GPU): start "
                                                "the ranks with torchrun --nproc_per_node 2")],
    "`--save-dir` that cannot be written": [
        (1, ["--save-dir", "{plain_file}/ckpt"],
         "--save-dir {plain_file}/ckpt cannot be written: {plain_file} is not a writable "
         "directory")],
    "a data directory without the language pair asked for": [
        (1, ["--source-lang", "xx", "--target-lang", "yy"],
         "data not found: {corpus}/dict.xx.txt; check DATA and --source-lang/--target-lang")],
    "a model whose tied weights cross a layer unit": [
        (1, ["--arch", "transformer_tied_layers"], "parameter tie between encoder.layers.0.fc1, "
                                                   "encoder.layers.1.fc1 crosses a layer unit",
         "tied_layers")],
    "a model with one module in several units (latent depth's `layer_select`, which every layer "
    "of its encoder holds, with layer units)": [
        (1, ["--user-dir", "examples/latent_depth/latent_depth_src", "--task",
             "multilingual_translation_latent_depth", "--arch", "latent_multilingual_transformer",
             "--lang-pairs", "src-tgt", "--encoder-latent-layer", "--share-encoders",
             "--share-decoders"],
         "module models.src-tgt.encoder.layer_select is also "
         "models.src-tgt.encoder.layers.0.layer_select, "
         "models.src-tgt.encoder.layers.1.layer_select: one module in several FSDP2 units",
         "fairseq_fsdp2.train")],
    "`--restore-file` or `--finetune-from-model` that does not exist": [
        (1, ["--restore-file", "{absent}"], "--restore-file not found: {absent}"),
        # 1 rank: preflight, as the 2-rank rows of the degrees above show on every rank
        (1, ["--finetune-from-model", "{absent}"], "--finetune-from-model not found: {absent}")],
    "Hugging Face weights (`--finetune-from-model DIR`) of another model or layer count, or a "
    "directory without them": [
        # 1 rank: rank 0 finds these reading the weights and broadcasts the line to the others
        # (checkpoint_hooks._load_pretrained), as for the narrow row below, which shows it on 2
        (1, ["--finetune-from-model", "{hf_bart}"], "{hf_bart} is a Hugging Face 'bart' model "
         "(BartForConditionalGeneration), not NLLB (model_type 'm2m_100'"),
        (1, ["--finetune-from-model", "{hf}", "--encoder-layers", "3"],
         "{hf} has 2 encoder and 2 decoder layers, the model (--arch transformer) 3 and 2"),
        (1, ["--finetune-from-model", "{no_model}"], "--finetune-from-model {no_model} is a "
         "directory without a Hugging Face model in it")],
    "a `--restore-file` that is not a checkpoint, or is truncated": [
        (1, ["--restore-file", "{text}"],
         "cannot read checkpoint {text}: not a PyTorch checkpoint"),
        (1, ["--restore-file", "{truncated}"], "cannot read checkpoint {truncated}: ")],
    "a checkpoint pickling other classes": [
        (1, ["--restore-file", "{stranger}"], "cannot read checkpoint {stranger}: it pickles "
                                              "datetime.date, which is not among the classes")],
    "a hydra override with an unknown key (`group.key=...` or `+group.key=...`)": [
        (1, ["distributed_training.fsdp2_no_such_option=1"], "distributed_training."
         "fsdp2_no_such_option is not an option of distributed_training", HYDRA),
        (1, ["+model.encoder_layrs=3"], "model.encoder_layrs is not an option of model "
                                        "'transformer_nllb_tiny'", HYDRA),
        (1, ["optimisation.lr=[0.1]"], "optimisation.lr: optimisation is not a config group",
         HYDRA)],
    "a sharded checkpoint with a missing or short shard": [
        (1, ["--restore-file", "{missing_shard}"], "shard file missing: {shard_dir}/__0_0.distcp"),
        (1, ["--restore-file", "{short_shard}"], "shard file truncated: {short_shard_file} (")],
    "resuming mid-epoch on a number of ranks that does not divide the batches done": [
        # the checkpoint: 1 rank, 1 update, 1 batch into the epoch
        (2, ["--restore-file", "{good}"], "cannot resume mid-epoch at 2 ranks: the checkpoint "
                                          "(saved at 1 ranks) is 1 batches into the epoch, not "
                                          "a multiple of 2")],
    "an FSDP2 checkpoint resumed by another backend (`--ddp-backend legacy_ddp`, ...) with its "
    "optimizer state": [
        (1, ["--restore-file", "{good}", "--ddp-backend", "legacy_ddp"],
         "{good} is an FSDP2 checkpoint: its optimizer state is in shards that --ddp-backend "
         "legacy_ddp cannot load; resume it with --ddp-backend fsdp2, or add --reset-optimizer")],
    "a checkpoint of another model config": [
        (1, ["--restore-file", "{good}", "--encoder-ffn-embed-dim", "48"],
         "{good} does not fit this model: encoder.layers.0.fc1.bias checkpoint (64,) vs "
         "model (48,)")],
    "`--finetune-from-model` of a model whose embedding has more rows than the dictionary "
    "has entries": [
        # 1 rank: every rank finds it in the shapes it loads (checkpoint_hooks._grows_embedding),
        # as every rank finds the mid-epoch row's (2 ranks)
        (1, ["--finetune-from-model", "{wider}"], "the dictionary has 88 entries, fewer than the "
         "91 rows of the embedding of {wider}: a dictionary for fine-tuning begins with the "
         "model's rows, in its order")],
    "a dictionary that puts the rows of a smaller `--finetune-from-model` model in another "
    "order": [
        # 2 ranks: rank 0 finds it reading the weights, and rank 1 stops on its broadcast
        (2, ["--finetune-from-model", "{narrow}"], "dictionary entry 4 is '{first}', but row 4 "
         "of {narrow} is '{second}' (its dictionary {narrow_dict}): a dictionary for "
         "fine-tuning keeps the model's rows in their order")],
    "a `--save-dir` the ranks do not share (each node its own directory)": [
        (2, ["--save-dir", "{save}-rank{{rank}}"],  # as two nodes with local directories
         "--save-dir is not the same directory on every rank: rank 1 (host ")],
}


def test_the_catalogue_covers_every_readme_row():
    assert catalogue_rows() == list(CATALOGUE)


CASES = [(row, i, *case, *([] if len(case) == 4 else ["fairseq_cli.train"]))
         for row, cases in CATALOGUE.items() for i, case in enumerate(cases)]


@pytest.mark.parametrize("row, i, ranks, flags, message, module", CASES,
                         ids=[f"{re.sub(r'[^a-z0-9]+', '-', row.lower()).strip('-')}-{i}"
                              for row, i, *_ in CASES])
def test_bad_input_stops_with_one_line_and_writes_nothing(files, tmp_path, monkeypatch, row, i,
                                                          ranks, flags, message, module):
    save = tmp_path / "ckpt"
    first, second = [line.split()[0] for line in
                     (files["corpus"] / "dict.src.txt").read_text().splitlines()[:2]]
    fill = {"save": str(save), "first": first, "second": second,
            **{k: str(v) for k, v in files.items()}}
    flags = [f.format(**fill) for f in flags]
    message = message.format(**fill)
    before = {p: p.read_bytes() for p in files.values() if p.is_file()}
    args = [files["corpus"], "--user-dir", PLUGIN, *TINY_MODEL, *TRAINING, *FSDP2,
            "--max-update", "2", "--save-dir", save, *flags]
    if module == HYDRA:
        monkeypatch.chdir(tmp_path)  # where hydra would write its job log
        args = ["--config-dir", REPO / "configs", "--config-name", "nllb_tiny_demo",
                f"task.data={files['corpus']}", f"checkpoint.save_dir={save}",
                "common.cpu=true", *flags]
    results = run_ranks(max(ranks, 1),
                        lambda r: [str(a).replace("{rank}", str(r)) for a in args],  # per rank
                        # REPO: the hydra cases run in tmp_path, where the checkout's own
                        # package would otherwise lose to the venv's editable install's
                        module=module, env={"PYTHONPATH": os.pathsep.join([PROBES, str(REPO)])},
                        timeout=120,
                        torchrun_env=ranks > 0)
    for r in results:
        errors = [l for l in r.output.splitlines() if l.startswith("fairseq_fsdp2: error:")]
        # one machine: its first rank says it (errors.prints_bad_input), every rank exits 2
        said = 1 if r.rank == 0 else 0
        assert r.returncode == 2 and len(errors) == said, f"rank {r.rank}:\n{r.output[-3000:]}"
        assert not said or message in errors[0], errors
        assert "Traceback" not in r.output and "begin training" not in r.output
        assert "usage:" not in r.output  # argparse's, fairseq's 120 lines
    assert not list(tmp_path.glob("ckpt*"))
    assert before == {p: p.read_bytes() for p in before}


def test_other_backends_keep_stock_fairseq_parse_errors(corpus):
    """A bad value of a fairseq flag in a run of another backend: argparse's usage and error, as
    stock fairseq prints them (only FSDP2 runs and the plugin's own flags get one line)."""
    result, = run_ranks(1, lambda r: [corpus, "--user-dir", PLUGIN, "--ddp-backend", "legacy_ddp",
                                      "--optimizer", "adamm"], timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert "usage: " in result.output
    assert "error: argument --optimizer: invalid choice: 'adamm'" in result.output
    assert "fairseq_fsdp2: error:" not in result.output


def test_train_sh_checks_the_command_line_before_torchrun(corpus, tmp_path):
    """NPROC=2 scripts/train.sh with bad input: one line and exit status 2 from the check
    before torchrun (no line per rank, no torchrun report), nothing written; a good command line
    passes the same check and writes nothing either."""
    save = tmp_path / "ckpt"
    args = [corpus, *TINY_MODEL, *TRAINING, "--min-params-to-wrap", "1", "--max-update", "2",
            "--save-dir", save]
    result = subprocess.run(["bash", REPO / "scripts" / "train.sh", *args, "--max-tokens", "0"],
                            env={**os.environ, "NPROC": "2"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert (result.stdout + result.stderr).splitlines() == [
        "fairseq_fsdp2: error: --max-tokens must be >= 1, got 0"]
    assert before_torchrun.main(["2", *args, "--user-dir", PLUGIN, "--ddp-backend", "fsdp2"]) == 0
    assert not save.exists()


# --- every range preflight checks (command_line/preflight.py NUMBER_RANGES) ------------------
# One bad value per checked flag, with the message the user reads. They run in this process
# through before_torchrun.main: the parsing, backend settling and checks scripts/train.sh runs
# before torchrun and every rank runs again (setup.set_up_run); a command line stopped there ends
# as the catalogue above shows end to end (one line, exit status 2), as the train.sh test does.
NUMBER_CASES = [
    ("--max-tokens", "-5", "--max-tokens must be >= 1, got -5"),
    ("--batch-size", "0", "--batch-size must be >= 1, got 0"),
    ("--max-tokens-valid", "0", "--max-tokens-valid must be >= 1, got 0"),
    ("--batch-size-valid", "-2", "--batch-size-valid must be >= 1, got -2"),
    ("--required-batch-size-multiple", "0",
     "--required-batch-size-multiple must be >= 1, got 0"),
    ("--num-workers", "-1", "--num-workers must be >= 0, got -1"),
    ("--validate-interval", "0", "--validate-interval must be >= 1, got 0"),
    ("--update-freq", "1,0", "--update-freq must be >= 1, got 1,0"),
    ("--max-update", "-1", "--max-update must be >= 0 (0: no limit), got -1"),
    ("--max-epoch", "-1", "--max-epoch must be >= 0 (0: no limit), got -1"),
    ("--lr", "-0.001", "--lr must be >= 0, got -0.001"),
    ("--log-interval", "0", "--log-interval must be >= 1, got 0"),
    ("--save-interval", "0", "--save-interval must be >= 1, got 0"),
    ("--warmup-updates", "-1", "--warmup-updates must be >= 0, got -1"),
    ("--max-source-positions", "0", "--max-source-positions must be >= 1, got 0"),
    ("--max-target-positions", "0", "--max-target-positions must be >= 1, got 0"),
    ("--dropout", "1.5", "--dropout must be between 0 and 1, got 1.5"),
    ("--attention-dropout", "-0.1", "--attention-dropout must be between 0 and 1, got -0.1"),
    ("--activation-dropout", "1.01", "--activation-dropout must be between 0 and 1, got 1.01"),
]
#: each flag at the edge of its range, all in one command line that passes
EDGES = ["--max-tokens", "1", "--batch-size", "1", "--max-tokens-valid", "1",
         "--batch-size-valid", "1", "--required-batch-size-multiple", "1", "--num-workers", "0",
         "--validate-interval", "1", "--update-freq", "1", "--max-update", "0", "--max-epoch",
         "0", "--lr", "0", "--log-interval", "1", "--save-interval", "1", "--warmup-updates",
         "0", "--max-source-positions", "1", "--max-target-positions", "1", "--dropout", "1",
         "--attention-dropout", "0", "--activation-dropout", "1"]


def precheck_line(corpus, save, *flags) -> list:
    return ["1", corpus, *TINY_MODEL, *TRAINING, "--user-dir", PLUGIN, "--ddp-backend", "fsdp2",
            "--save-dir", save, *flags]


def test_every_checked_range_has_a_case_and_a_catalogue_row():
    from fairseq_fsdp2.command_line.preflight import NUMBER_RANGES
    flags = [flag for flag, _, _ in NUMBER_CASES]
    assert sorted(flags) == sorted(row[2] for row in NUMBER_RANGES)
    assert sorted(EDGES[::2]) == sorted(flags)
    rows = " ".join(catalogue_rows())
    assert [f for f in flags if f"`{f}" not in rows] == []  # docs/errors.md names each


@pytest.mark.parametrize("flag, value, message", NUMBER_CASES, ids=[c[0] for c in NUMBER_CASES])
def test_a_number_out_of_its_range_stops_with_one_line(corpus, tmp_path, capsys, flag, value,
                                                       message):
    save = tmp_path / "ckpt"
    status = before_torchrun.main([str(a) for a in precheck_line(corpus, save, flag, value)])
    out, err = capsys.readouterr()
    # the command's main returns its exit status (its __main__ block exits with it)
    assert status == 2 and err.splitlines() == [f"fairseq_fsdp2: error: {message}"], out + err
    assert not save.exists()


def test_numbers_at_the_edges_of_their_ranges_pass(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert before_torchrun.main([str(a) for a in precheck_line(corpus, save, *EDGES)]) == 0
    assert "error" not in capsys.readouterr().err
    assert not save.exists()


@pytest.fixture
def read_only_dir(tmp_path):
    """An empty directory on a read-only file system (conftest.tmpfs)."""
    with tmpfs(tmp_path / "read-only", "ro,size=64k") as path:
        yield path


@pytest.mark.parametrize("module, where, message", [
    ("fairseq_fsdp2.consolidate", "{read_only}/out.pt",
     "fairseq_fsdp2: error: cannot write {out}: {read_only} is not a writable directory"),
    ("fairseq_fsdp2.consolidate", "{plain_file}/out.pt",
     "fairseq_fsdp2: error: cannot write {out}: {plain_file} is not a writable directory"),
    ("fairseq_fsdp2.consolidate", "{tmp}/no-such-dir/out.pt",
     "fairseq_fsdp2: error: cannot write {out}: {tmp}/no-such-dir does not exist"),
    ("fairseq_fsdp2.plot_memory", "{read_only}/memory.png", "fairseq_fsdp2.plot_memory: error: "
     "cannot write {out}: {read_only} is not a writable directory"),
    ("fairseq_fsdp2.data.prepare", "{read_only}/data", "prepare_data: error: destination {out} "
     "cannot be written: {read_only} is not a writable directory")],
    ids=["consolidate-read-only", "consolidate-under-a-file", "consolidate-missing-dir",
         "plot-memory-read-only", "prepare-data-read-only"])
def test_an_output_that_cannot_be_written_stops_before_reading(files, tmp_path, request,
                                                                module, where, message):
    """Our other commands: an output they cannot write is one line, exit status 2, before they
    read their input (the checkpoint, the memory log, the raw text); nothing is written."""
    read_only = request.getfixturevalue("read_only_dir") if "read_only" in where else None
    out = where.format(read_only=read_only, plain_file=files["plain_file"], tmp=tmp_path)
    inputs = {"fairseq_fsdp2.consolidate": [files["good"]],
              "fairseq_fsdp2.plot_memory": [tmp_path / "memory.jsonl"],  # never read
              "fairseq_fsdp2.data.prepare": [files["corpus"].parent / "raw"]}[module]
    before = files["good"].read_bytes()
    result, = run_ranks(1, lambda r: [*inputs, out], module=module, torchrun_env=False,
                        timeout=120)
    errors = [l for l in result.output.splitlines() if ": error:" in l]
    assert result.returncode == 2 and errors == [
        message.format(out=out, read_only=read_only, plain_file=files["plain_file"],
                       tmp=tmp_path)], result.output[-3000:]
    assert "Traceback" not in result.output
    assert not os.path.exists(out) and files["good"].read_bytes() == before
    assert read_only is None or not os.listdir(read_only)
