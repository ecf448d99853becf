"""NLLB weights from and to the Hugging Face format (checkpoint/hf_nllb.py, data/hf_vocab.py).

The "hub" model is written by transformers itself (tests/hf_reference.py, in its own process):
a random tiny M2M100ForConditionalGeneration with transformer_nllb_tiny's dimensions, saved
with save_pretrained (safetensors), with an NllbTokenizer built from a BPE SentencePiece model
(NLLB's is BPE too) and two embedding rows more than the tokenizer has tokens (as NLLB-200).
``scripts/prepare_data.sh --hf-model`` builds the data's dictionary from it. Then:
- every dictionary entry sits on the row of HF's tokenizer, and both encode text alike;
- the fairseq model loaded from the hub weights gives HF's logits;
- a 2-rank fine-tune from the HF directory has the losses of one from the same weights in a
  fairseq checkpoint;
- ``scripts/finetune_nllb.sh --pretrained HF_DIR --lora-rank 4`` trains adapters on the hub's
  weights, kept bit for bit as the frozen base;
- its sharded and consolidated checkpoints export (``consolidate --format hf``) to the same
  files, which transformers loads: same logits as fairseq, the same greedy translations as
  stock fairseq-generate; the export reads back (fairseq -> HF -> fairseq) bit for bit;
- bad sources and mismatched dictionaries stop with one line.

transformers and its dependencies are test-only (requirements-dev.txt), installed by
scripts/setup.sh into .venv/fixture-deps, which only hf_reference.py's process gets on its path;
the plugin itself reads and writes safetensors without them.
"""
from __future__ import annotations

import filecmp
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import FIXTURE_DEPS, PLUGIN, TESTS, need_fixture_dep
from launcher import (base_env, finish_ranks, fork_server, ok, start_command, start_ranks,
                      train_inner)
from hf_compare import (as_float64, assert_logits_close, assert_same_greedy_choices, greedy,
                        greedy_gaps, hypothesis)

from fairseq_fsdp2.consolidate import main as consolidate_main
from fairseq_fsdp2.data import numbers
from fairseq_fsdp2.hf import nllb_weights as hf_nllb, vocab as hf_vocab
from fairseq_fsdp2.data.prepare import prepare, read_lines, train_spm
from fairseq_fsdp2.errors import CheckpointError

PAIR = ("eng_Latn", "fra_Latn")
TINY = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=128,
            decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4,
            max_position_embeddings=512, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
            init_std=0.5)  # large weights: greedy outputs that differ by source, far from ties
MAX_LEN = 12  # fairseq-generate --max-len-b: tokens before the forced end of sentence



class Reference:
    """tests/hf_reference.py's ``serve``: the transformers side in its own process, one per
    test module (its transformers import, seconds, paid once for the module's ``make`` and
    ``check``), forked from the tests' server as the PEFT reference is (test_lora.py):
    torch and torch.distributed are imported there already, which a fresh interpreter paid
    again (measured with AVX2 imitated: 4.3 CPU-s to import torch and transformers afresh,
    1.3 for transformers in a forked child). transformers and its dependencies are still
    on this process's path only. ``ask`` writes a request to its stdin, a named pipe;
    ``answer`` waits for its answer line in its output (stdout and stderr together:
    ``output.log`` beside the pipe)."""

    def __init__(self, root: Path):
        self.log, requests = root / "output.log", root / "requests"
        os.mkfifo(requests)
        # read and write: opens at once, and the process's own read end too; closed: its EOF
        self._requests = os.open(requests, os.O_RDWR)
        self.proc = fork_server().start(
            "hf_reference", ["serve"],
            base_env({"PYTHONPATH": os.pathsep.join(map(str, (FIXTURE_DEPS, TESTS)))}),
            str(self.log), str(requests))
        self._read = 0  # bytes of the output before the answer awaited

    def ask(self, *args) -> None:
        os.write(self._requests, (json.dumps([str(a) for a in args]) + "\n").encode())

    def answer(self, timeout: float = 300) -> None:
        """The request's ``ok``; a traceback (serve prints the request's exception, then its
        answer), the process's end or ``timeout`` fail with the output's end."""
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log, "rb") as f:
                f.seek(self._read)
                new = f.read()
            lines = new.split(b"\n")[:-1]  # whole lines (a progress bar's \r parts on one)
            for n, line in enumerate(lines):
                if line.rsplit(b"\r", 1)[-1].strip() == b"ok":
                    self._read += sum(len(x) + 1 for x in lines[:n + 1])
                    return
            if b"Traceback (most recent call last):" in new or self.proc.poll() is not None \
                    or time.monotonic() > deadline:
                time.sleep(1)  # the rest of the traceback and the answer line
                raise AssertionError(f"no answer (exit status {self.proc.poll()}):\n"
                                     f"{self.log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.05)

    def close(self) -> None:
        os.close(self._requests)  # the end of its stdin: serve returns
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        if code != 0:
            raise AssertionError(self.log.read_text(errors="replace")[-4000:])


@pytest.fixture(scope="module")
def hf_side(tmp_path_factory):
    need_fixture_dep("transformers", "for the reference side")
    reference = Reference(tmp_path_factory.mktemp("hf_side"))
    yield reference
    reference.close()


@pytest.fixture(scope="module")
def hub(hf_side, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_nllb")
    numbers.write_corpus(root / "raw", [PAIR], n_train=600, n_valid=30, n_test=30, seed=2)
    texts = [line for lang in PAIR
             for line in read_lines(root / "raw" / f"train.{PAIR[0]}-{PAIR[1]}.{lang}")]
    spm_model = train_spm(texts, root / "spm", 100, "bpe", 100_000, seed=1)
    request = {"src_lang": PAIR[0], "tgt_lang": PAIR[1], "seed": 1, "config": TINY,
               "src": [[1, 1, 148, 10, 11, 12, 2], [148, 20, 21, 22, 23, 24, 2]],
               "prev": [[2, 158, 30, 31, 32], [2, 158, 40, 41, 42]],
               "gen_src": [], "max_new_tokens": 1,
               "texts": ["one hundred and twelve", "seven thousand", "ninety-nine"]}
    (root / "request.json").write_text(json.dumps(request))
    hf_side.ask("make", spm_model, root / "hub", root / "request.json", root / "hub.json")
    hf_side.answer()
    data = prepare(root / "raw", root / "data", hf_model=root / "hub", log=lambda *a: None)
    return SimpleNamespace(root=root, dir=root / "hub", data=data, request=request,
                           result=json.loads((root / "hub.json").read_text()))


def task_and_model(data: Path, **overrides):
    """The task (its dictionary) and an untrained transformer_nllb_tiny, as fairseq-train
    builds them for this data."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = [str(data), "--user-dir", PLUGIN, "--arch", "transformer_nllb_tiny", *task_flags(data),
            "--cpu"] + [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()]
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), args))
    task = tasks.setup_task(cfg.task)
    return cfg, task, task.build_model(cfg.model).eval()


def task_flags(data: Path) -> list[str]:
    return ["--task", "translation_multi_simple_epoch", "--lang-pairs", "-".join(PAIR),
            "--langs", (data / "langs.txt").read_text().strip(),
            "--encoder-langtok", "src", "--decoder-langtok"]


def shapes(model) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def nllb_tiny(hub):
    """task_and_model's config and task for the hub's data: one config conversion (hydra's,
    ~0.2 CPU-s) for the module's tests that read them; each builds its own untrained model
    from them (``task.build_model``, milliseconds)."""
    cfg, task, _ = task_and_model(hub.data)
    return cfg, task


# --- the dictionary ---------------------------------------------------------------------------

def test_every_dictionary_entry_is_on_the_hf_tokenizer_row(hub, nllb_tiny):
    _, task = nllb_tiny
    d = task.source_dictionary
    vocab = hub.result["vocab"]
    assert len(d) == hub.result["vocab_size"] == len(vocab) + 2  # NLLB's two spare rows
    hf_name = {i: t for t, i in vocab.items()}
    assert [hf_vocab.fairseq_token(hf_name[i]) for i in range(len(vocab))] == d.symbols[:len(vocab)]
    assert d.index("__eng_Latn__") == vocab["eng_Latn"] and d.index("<mask>") == vocab["<mask>"]
    # and text encodes to the same ids: NLLB's source side is [lang] pieces </s>
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(hub.data / "spm.model"))
    for text, ids in zip(hub.request["texts"], hub.result["text_ids"]):
        ours = [d.index("__eng_Latn__")] + [d.index(p) for p in sp.encode(text, out_type=str)]
        assert ours + [d.eos()] == ids and d.unk() not in ours


def test_a_misplaced_dictionary_entry_stops_with_one_line(hub, nllb_tiny, tmp_path):
    cfg, task = nllb_tiny
    model = task.build_model(cfg.model)
    symbols = list(task.source_dictionary.symbols)
    rows = len(symbols)
    lang = symbols.index("__eng_Latn__")
    swapped = list(symbols)
    swapped[lang], swapped[lang + 1] = swapped[lang + 1], swapped[lang]
    bare = tmp_path / "bare"  # weights only: no tokenizer to compare with
    bare.mkdir()
    shutil.copy(hub.dir / "model.safetensors", bare / "nllb.safetensors")
    cases = [
        (hub.dir, symbols[:-1], f"the dictionary has {rows - 1} entries and the model's "
                                f"embedding {rows} rows: build the data with "
                                f"scripts/prepare_data.sh RAW DEST --hf-model {hub.dir}"),
        (hub.dir, swapped, f"dictionary entry {lang} is '{symbols[lang + 1]}', but row {lang} "
                           f"of the model is '__eng_Latn__' for its tokenizer"),
        (bare / "nllb.safetensors", swapped,
         f"dictionary entry {lang + 1} is __eng_Latn__, but the model's tokenizer puts the "
         f"NLLB languages in one block in NLLB's order"),
    ]
    for source, dictionary, message in cases:
        with pytest.raises(CheckpointError) as e:
            hf_nllb.open_checked(str(source), cfg.model, shapes(model), dictionary)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert hf_nllb.open_checked(str(bare / "nllb.safetensors"), cfg.model, shapes(model),
                                symbols) is not None  # the right one passes without tokenizer


def test_prepare_data_hf_model_refuses_other_vocabularies(hub, tmp_path):
    from fairseq_fsdp2.data.prepare import PrepareError
    raw = hub.root / "raw"
    cases = [({"spm_model": hub.dir / "sentencepiece.bpe.model"},
              "--hf-model brings its own SentencePiece model and dictionary"),
             ({"hf_model": tmp_path}, f"--hf-model: {tmp_path / 'config.json'} not found")]
    for extra, message in cases:
        with pytest.raises(PrepareError) as e:
            prepare(raw, tmp_path / "out", **{"hf_model": hub.dir, **extra}, log=lambda *a: None)
        assert str(e.value).startswith(message), str(e.value)
    assert not (tmp_path / "out").exists()


# --- import -----------------------------------------------------------------------------------

def test_hub_weights_give_the_hf_logits_in_fairseq(hub, nllb_tiny):
    cfg, task = nllb_tiny
    model = task.build_model(cfg.model).eval()
    weights = hf_nllb.open_checked(str(hub.dir), cfg.model, shapes(model),
                                   task.source_dictionary.symbols)
    model.load_state_dict(dict(weights), strict=True)
    assert_logits_close(model, as_float64(model), hub.request, hub.result)


def test_sharded_safetensors_read_the_same(hub, tmp_path):
    """A model saved in several files (model.safetensors.index.json), as the larger hub
    models are, reads as the single file does."""
    from fairseq_fsdp2.hf.safetensors_io import SafetensorsFile, write

    single = SafetensorsFile(str(hub.dir / "model.safetensors"))
    names = single.keys()
    sharded = tmp_path / "sharded"
    shutil.copytree(hub.dir, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    parts = {"model-00001-of-00002.safetensors": names[::2],
             "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in parts.items():
        write(str(sharded / file), [(n, single.tensor(n)) for n in part], {"format": "pt"})
    (sharded / hf_nllb.INDEX).write_text(json.dumps(
        {"weight_map": {n: f for f, part in parts.items() for n in part}}))
    a, b = hf_nllb.HFWeights(str(hub.dir)), hf_nllb.HFWeights(str(sharded))
    assert hf_nllb.is_hf_source(str(sharded)) and set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_other_architectures_and_files_stop_with_one_line(hub, nllb_tiny, tmp_path):
    cfg, task = nllb_tiny
    model = task.build_model(cfg.model)
    symbols = task.source_dictionary.symbols
    bart, truncated = tmp_path / "bart", tmp_path / "truncated"
    for d in (bart, truncated):
        shutil.copytree(hub.dir, d)
    config = json.loads((bart / "config.json").read_text())
    (bart / "config.json").write_text(json.dumps(
        {**config, "model_type": "bart", "architectures": ["BartForConditionalGeneration"]}))
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    deeper_cfg, _, deeper = task_and_model(hub.data, encoder_layers=3)
    cases = [
        (bart, cfg, model, f"{bart} is a Hugging Face 'bart' model (BartForConditionalGeneration), "
                      f"not NLLB (model_type 'm2m_100', M2M100ForConditionalGeneration)"),
        (truncated, cfg, model, f"cannot read {truncated / 'model.safetensors'}: tensor "),
        (hub.dir, deeper_cfg, deeper, f"{hub.dir} has 2 encoder and 2 decoder layers, the model "
                          f"(--arch transformer_nllb_tiny) 3 and 2"),
    ]
    for source, model_cfg, target, message in cases:
        with pytest.raises(CheckpointError) as e:
            hf_nllb.open_checked(str(source), model_cfg.model, shapes(target), symbols)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


# --- fine-tuning from HF weights, export back -------------------------------------------------

def finetune_args(hub, source, save, updates):
    return lambda rank: [
        str(hub.data), "--user-dir", PLUGIN, "--ddp-backend", "fsdp2",
        "--arch", "transformer_nllb_tiny", "--finetune-from-model", str(source),
        *task_flags(hub.data), "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
        "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
        "--warmup-init-lr", "1e-7", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--max-tokens", "2000", "--max-update", str(updates),
        "--cpu", "--num-workers", "0", "--log-format", "json", "--log-interval", "1",
        "--seed", "1", "--no-progress-bar", "--disable-validation", "--save-dir", str(save),
        "--no-epoch-checkpoints"] + (["--no-save"] if updates == 1 else [])


def recipe_lora_args(hub, save) -> list[str]:
    """``scripts/finetune_nllb.sh --pretrained HUB_DIR --lora-rank 4`` (tiny, 2 CPU ranks, 2
    updates): the fairseq-train arguments its --dry-run prints (test_nllb_finetune.py runs the
    script's own launch; each fresh interpreter costs seconds)."""
    proc = subprocess.run(
        ["bash", str(TESTS.parent / "scripts" / "finetune_nllb.sh"), "--data", str(hub.data),
         "--model-size", "tiny", "--cpu", "--nproc", "2", "--pretrained", str(hub.dir),
         "--lora-rank", "4", "--max-update", "2", "--max-tokens", "2000", "--lr", "3e-3",
         "--log-interval", "1", "--seed", "1", "--save-dir", str(save), "--dry-run", "--",
         "--log-format", "json", "--no-epoch-checkpoints"],
        capture_output=True, text=True, env=base_env(), timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[2:4] == ["--nproc_per_node", "2"] and cmd[4].endswith("fairseq-train"), cmd
    return cmd[5:]


#: the fine-tune from the HF directory: its first update is compared, its last shows that it
#: trains (loss down by more than 1: 17.53 at update 1, 14.96 at update 6 on this machine), its
#: checkpoint is exported; updates 7-10 (it was 10) showed nothing more, at two ranks' cost
FROM_HF_UPDATES = 6


@pytest.fixture(scope="module")
def finetuned(hub):
    """Three 2-rank fine-tunes at once: from the HF directory (FROM_HF_UPDATES, saved), from the
    same weights in a fairseq checkpoint file (1 update), and LoRA from the HF directory
    through scripts/finetune_nllb.sh (2 updates, saved)."""
    as_fairseq = hub.root / "hub_as_fairseq.pt"
    weights = hf_nllb.HFWeights(str(hub.dir))
    torch.save({"model": {k: v.clone() for k, v in weights.items()}}, as_fairseq)
    runs = {name: start_ranks(2, finetune_args(hub, source, hub.root / name, updates))
            for name, source, updates in (("from_hf", hub.dir, FROM_HF_UPDATES),
                                          ("from_fairseq", as_fairseq, 1))}
    lora_args = recipe_lora_args(hub, hub.root / "lora")
    runs["lora"] = start_ranks(2, lambda rank: lora_args)
    outputs = {name: ok(finish_ranks(procs, timeout=240)) for name, procs in runs.items()}
    return SimpleNamespace(save=hub.root / "from_hf", lora_save=hub.root / "lora",
                           outputs=outputs)


@pytest.mark.slow
def test_finetune_from_hf_weights_has_the_fairseq_checkpoints_first_update(finetuned):
    from_hf = train_inner(finetuned.outputs["from_hf"])
    from_fairseq = train_inner(finetuned.outputs["from_fairseq"])
    assert "loaded pretrained weights from" in finetuned.outputs["from_hf"]
    assert len(from_hf) == FROM_HF_UPDATES and len(from_fairseq) == 1
    keys = ("loss", "nll_loss", "gnorm", "wpb", "bsz")
    assert {k: from_hf[0][k] for k in keys} == {k: from_fairseq[0][k] for k in keys}
    assert float(from_hf[-1]["loss"]) < float(from_hf[0]["loss"]) - 1.0  # and it trains


@pytest.mark.slow
def test_lora_from_the_hf_directory_through_finetune_nllb_sh(hub, finetuned):
    """``finetune_nllb.sh --pretrained HF_DIR --lora-rank 4`` (docs/lora.md) loads the weights
    transformers wrote and trains adapters on them: the saved frozen base is the hub's every
    tensor bit for bit, every adapter's B moved from its zero start, and the run exports its
    merged model."""
    from fairseq_fsdp2.checkpoint.export import lora_tensors
    output = finetuned.outputs["lora"]
    assert f"loaded pretrained weights from {hub.dir}" in output
    assert "LoRA rank 4: 32 linear modules adapted" in output
    assert [int(r["num_updates"]) for r in train_inner(output)] == [1, 2]
    path = finetuned.lora_save / "checkpoint_last.pt"
    tensors = lora_tensors(str(path), torch.load(path, weights_only=True))
    weights = hf_nllb.HFWeights(str(hub.dir))
    assert set(tensors) - set(weights) == {k for k in tensors if ".lora_" in k}
    for key in weights:
        assert torch.equal(tensors[key], weights[key]), key
    trained = [k for k in tensors if k.endswith(".lora_B")]
    assert len(trained) == 32 and all(tensors[k].abs().sum() > 0 for k in trained)
    export = torch.load(finetuned.lora_save / "checkpoint_last_consolidated.pt",
                        weights_only=True)["model"]
    assert set(export) == set(weights)


@pytest.mark.slow
def test_export_loads_in_transformers_and_matches_fairseq(hub, hf_side, finetuned, tmp_path):
    from fairseq.data import data_utils

    sharded_ckpt = finetuned.save / "checkpoint_last.pt"
    consolidated = finetuned.save / "checkpoint_last_consolidated.pt"
    out, out2 = tmp_path / "hf", tmp_path / "hf_from_consolidated"
    assert consolidate_main([str(sharded_ckpt), str(out), "--format", "hf"]) == 0
    assert consolidate_main([str(consolidated), str(out2), "--format", "hf"]) == 0
    assert filecmp.cmp(out / "model.safetensors", out2 / "model.safetensors", shallow=False)

    # fairseq -> HF -> fairseq, bit for bit, every tensor under every alias
    state = torch.load(consolidated, weights_only=True)["model"]
    back = hf_nllb.HFWeights(str(out))
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)

    # transformers on the export, fairseq-generate on the checkpoint, side by side
    cfg, task, model = task_and_model(hub.data, source_lang=PAIR[0], target_lang=PAIR[1])
    cfg.generation.beam, cfg.generation.max_len_a, cfg.generation.max_len_b = 1, 0, MAX_LEN
    d = task.source_dictionary
    model.load_state_dict(state, strict=True)
    test = data_utils.load_indexed_dataset(
        str(hub.data / f"test.{PAIR[0]}-{PAIR[1]}.{PAIR[0]}"), d)
    sources = [[d.index(f"__{PAIR[0]}__")] + test[i].tolist() for i in range(len(test))]
    request = dict(hub.request, gen_src=sources, tgt_lang_id=d.index(f"__{PAIR[1]}__"),
                   max_new_tokens=MAX_LEN + 1)
    (tmp_path / "request.json").write_text(json.dumps(request))
    hf_side.ask("check", out, tmp_path / "request.json", tmp_path / "result.json")
    # stock fairseq-generate (a process that never imports the plugin), beside transformers,
    # one sentence per batch (--batch-size 1): the very float32 computation that fairseq's
    # generator makes for one sentence in this process (the same code, weights, shapes and one
    # thread), so the same tokens and score whatever the CPU's kernels round: compared exactly
    # below (the score, which any change of a weight the sentence uses moves, as printed: the
    # float32 value's shortest repr)
    gen = start_command(
        "fairseq_cli.generate", hub.data, "--path", consolidated, *task_flags(hub.data),
        "--source-lang", PAIR[0], "--target-lang", PAIR[1], "--gen-subset", "test",
        "--beam", "1", "--max-len-a", "0", "--max-len-b", MAX_LEN, "--batch-size", "1",
        "--required-batch-size-multiple", "1", "--cpu", "--num-workers", "0")
    hf_side.answer()
    (generate,) = finish_ranks([gen], timeout=240)
    generated = generate.output
    assert generate.returncode == 0 and "fairseq_fsdp2" not in generated, generated[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())

    model64 = as_float64(model)
    assert_logits_close(model, model64, request, result)
    printed = {int(m[1]): (m[2], m[3].split())
               for m in re.finditer(r"^H-(\d+)\t(\S+)\t(.*)$", generated, re.M)}
    assert len(printed) == len(sources)
    generator = task.build_generator([model], cfg.generation)
    generator64 = task.build_generator([model64], cfg.generation)
    distinct = set()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fairseq-generate's process (OMP_NUM_THREADS=1)
    try:
        for i, (src, theirs) in enumerate(zip(sources, result["generated"])):
            # transformers (float64) against fairseq in float64, with the near-tie rule
            ours = greedy(task, generator64, model64, src)
            # HF: decoder start </s>, forced language, tokens (to max_new_tokens); fairseq:
            # language (the prefix), tokens, </s> (forced after MAX_LEN tokens)
            assert theirs[0] == 2 and ours[0] == theirs[1] == request["tgt_lang_id"]
            n = len(ours) if len(ours) <= MAX_LEN else MAX_LEN  # else: forced to end
            assert_same_greedy_choices(theirs[1:n + 1], ours[:n], greedy_gaps(model64, src, ours),
                                       i)
            # stock fairseq-generate printed what fairseq's float32 generator makes here,
            # token for token (without language tokens, fairseq's way), with the same score
            # (fairseq-generate's: base 2)
            hypo = hypothesis(task, generator, model, src)
            shown = d.string(hypo["tokens"],
                             extra_symbols_to_ignore=generator.symbols_to_strip_from_output)
            here = ("{}".format(hypo["score"] / math.log(2)), shown.split())
            assert printed[i] == here, (i, printed[i], here)
            distinct.add(tuple(ours))
    finally:
        torch.set_num_threads(threads)
    assert len(distinct) > 5  # the outputs depend on the source
