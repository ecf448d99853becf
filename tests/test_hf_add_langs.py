"""A language the model never saw, added to a Hugging Face NLLB model and exported back.

The "hub" model is written by transformers itself (tests/hf_reference.py, as in
test_hf_nllb.py) with a BPE SentencePiece model trained on English and French numbers only.
``prepare(..., hf_model=HUB, add_langs="lat_Latn,xxx_Cyrl", train_pieces=N)`` grows its
vocabulary for English -> Latin data: the dictionary keeps the hub's rows, then the two new
language codes, the Latin pieces the hub's SentencePiece model lacks, fairseq's padding; the
SentencePiece model and the tokenizer files (DEST/hf_tokenizer) are grown alike. A 2-rank
FSDP2 fine-tune from the hub directory grows the embedding (checkpoint/grown_embedding.py);
``consolidate --format hf`` writes a directory that transformers loads with the bigger
vocab_size, whose AutoTokenizer splits Latin into the new pieces on the dictionary's rows, and
whose greedy ``generate`` with the new language code forced first gives the fairseq model's
greedy translations. Beside that run, LoRA adds the languages from the hub directory
(``--lora-rank 4 --lora-train-new-rows``): the hub's rows and weights kept bit for bit, the added
rows and the adapters trained.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import sentencepiece as spm
import torch

from conftest import PLUGIN
from launcher import finish_ranks, ok, start_ranks, train_inner
from hf_compare import (as_float64, assert_logits_close, assert_same_greedy_choices, greedy,
                        greedy_gaps)
from test_hf_nllb import MAX_LEN, TINY, hf_side  # noqa: F401  (the module's transformers side)

from fairseq_fsdp2.models.nllb_languages import lang_of_token
from fairseq_fsdp2.consolidate import main as consolidate_main
from fairseq_fsdp2.data import numbers
from fairseq_fsdp2.data.growth_record import GROWTH_FILE
from fairseq_fsdp2.data.prepare import prepare, read_lines, train_spm
from fairseq_fsdp2.hf import vocab as hf_vocab

PAIR = ("eng_Latn", "lat_Latn")
NEW_LANGS = ("lat_Latn", "xxx_Cyrl")
TRAIN_PIECES = 80
#: the 2-rank fine-tune's updates: the first at --warmup-init-lr (1e-7), the second (7.5e-4)
#: moves every row the data reaches, the added ones too: the export then holds trained added
#: rows, each unlike the row it started from, and the greedy translations use them (36 of 288
#: tokens here; 93 after 6 updates, which showed nothing more at 2 ranks' cost)
UPDATES = 2


def flags(data: Path) -> list[str]:
    return ["--task", "translation_multi_simple_epoch", "--lang-pairs", "-".join(PAIR),
            "--langs", (data / "langs.txt").read_text().strip(), "--encoder-langtok", "src",
            "--decoder-langtok", "--arch", "transformer_nllb_tiny"]


@pytest.fixture(scope="module")
def grown(hf_side, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_add_langs")
    numbers.write_corpus(root / "hub_raw", [("eng_Latn", "fra_Latn")], n_train=600, n_valid=0,
                         n_test=0, seed=2)
    texts = [line for lang in ("eng_Latn", "fra_Latn")
             for line in read_lines(root / "hub_raw" / f"train.eng_Latn-fra_Latn.{lang}")]
    hub_spm = train_spm(texts, root / "spm", 100, "bpe", 100_000, seed=1)
    request = {"src_lang": "eng_Latn", "tgt_lang": "fra_Latn", "seed": 1, "config": TINY,
               "src": [[148, 10, 2]], "prev": [[2, 10]], "gen_src": [], "max_new_tokens": 1,
               "texts": []}
    (root / "request.json").write_text(json.dumps(request))
    hf_side.ask("make", hub_spm, root / "hub", root / "request.json", root / "hub.json")
    hf_side.answer()
    hub = root / "hub"

    numbers.write_corpus(root / "raw", [PAIR], n_train=800, n_valid=0, n_test=24, seed=3)
    data = prepare(root / "raw", root / "data", hf_model=hub, add_langs=",".join(NEW_LANGS),
                   train_pieces=TRAIN_PIECES, log=lambda *a: None)
    save = root / "ckpt"

    def finetune(save, updates, *extra):
        return start_ranks(2, lambda rank: [
            str(data), "--user-dir", PLUGIN, "--ddp-backend", "fsdp2", *flags(data),
            "--finetune-from-model", str(hub), "--init-new-langs-from", "eng_Latn",
            "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "3e-3",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4", "--warmup-init-lr",
            "1e-7", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", "2000", "--max-update", str(updates), "--cpu", "--num-workers", "0",
            "--log-format", "json", "--log-interval", "1", "--seed", "1", "--no-progress-bar",
            "--disable-validation", "--save-dir", str(save), "--no-epoch-checkpoints", *extra])
    # beside it, LoRA adding the languages (docs/lora.md): adapters and the added rows train
    runs = {"full": finetune(save, UPDATES),
            "lora": finetune(root / "lora", 2, "--lora-rank", "4", "--lora-train-new-rows")}
    outputs = {name: ok(finish_ranks(procs, timeout=300)) for name, procs in runs.items()}
    out = root / "hf"
    assert consolidate_main([str(save / "checkpoint_last.pt"), str(out), "--format", "hf"]) == 0
    return SimpleNamespace(root=root, hub=hub, data=data, output=outputs["full"], out=out,
                           checkpoint=save / "checkpoint_last_consolidated.pt",
                           lora_output=outputs["lora"], lora_save=root / "lora")


def task_and_model(data: Path, checkpoint: Path):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = [str(data), "--user-dir", PLUGIN, *flags(data), "--source-lang", PAIR[0],
            "--target-lang", PAIR[1], "--cpu"]
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), args))
    cfg.generation.beam, cfg.generation.max_len_a, cfg.generation.max_len_b = 1, 0, MAX_LEN
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model).eval()
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"], strict=True)
    return cfg, task, model


def test_dictionary_and_sentencepiece_model_are_grown(grown):
    lines = (grown.data / "dict.txt").read_text(encoding="utf-8").splitlines()
    tokens = ["<s>", "<pad>", "</s>", "<unk>"] + [line.split(" ")[0] for line in lines]
    hub_rows = json.loads((grown.hub / "config.json").read_text())["vocab_size"]
    expected = hf_vocab.expected_rows(grown.hub, hub_rows)
    assert all(t == e for t, e in zip(tokens, expected) if e is not None)  # the hub's rows
    record = json.loads((grown.data / GROWTH_FILE).read_text(encoding="utf-8"))
    assert record["model_rows"] == hub_rows and record["rows"] == len(tokens)
    assert tokens[hub_rows:hub_rows + 2] == [f"__{c}__" for c in NEW_LANGS]
    pieces = list(record["pieces"])
    assert pieces and tokens[hub_rows + 2:hub_rows + 2 + len(pieces)] == pieces
    assert len(tokens) % 8 == 0 and all(t.startswith("madeupword")  # fairseq's padding
                                        for t in tokens[hub_rows + 2 + len(pieces):])
    # the copy of the SentencePiece model has the pieces, after the hub's, with BPE scores
    # below all of the hub's (its merges first); Latin now takes fewer pieces
    old = spm.SentencePieceProcessor(model_file=str(grown.hub / "sentencepiece.bpe.model"))
    new = spm.SentencePieceProcessor(model_file=str(grown.data / "spm.model"))
    n = old.get_piece_size()
    assert [new.id_to_piece(i) for i in range(n)] == [old.id_to_piece(i) for i in range(n)]
    assert [new.id_to_piece(i) for i in range(n, new.get_piece_size())] == pieces
    assert max(new.get_score(i) for i in range(n, new.get_piece_size())) < \
        min(old.get_score(i) for i in range(3, n))
    latin = read_lines(grown.root / "raw" / "train.eng_Latn-lat_Latn.lat_Latn")
    before = sum(len(p) for p in old.encode(latin, out_type=str))
    after = sum(len(p) for p in new.encode(latin, out_type=str))
    assert after < 0.7 * before, (before, after)
    assert "grew the shared embedding" in grown.output
    assert len(train_inner(grown.output)) == UPDATES


def test_export_loads_in_transformers_tokenizes_the_new_language_and_generates_alike(
        grown, hf_side, tmp_path):
    cfg, task, model = task_and_model(grown.data, grown.checkpoint)
    d = task.source_dictionary
    sp = spm.SentencePieceProcessor(model_file=str(grown.data / "spm.model"))
    raw = grown.root / "raw"
    english = read_lines(raw / "test.eng_Latn-lat_Latn.eng_Latn")
    latin = read_lines(raw / "test.eng_Latn-lat_Latn.lat_Latn")

    def fairseq_ids(lang: str, text: str) -> list[int]:
        return [d.index(f"__{lang}__")] + [d.index(p) for p in sp.encode(text, out_type=str)]

    sources = [fairseq_ids(PAIR[0], t) + [d.eos()] for t in english]
    lat = d.index("__lat_Latn__")
    width = max(len(sources[0]), len(sources[1]))  # left-padded, as fairseq batches them
    request = {"src_lang": PAIR[1], "texts": latin, "texts_by_lang": {PAIR[0]: english},
               "src": [[d.pad()] * (width - len(s)) + s for s in sources[:2]],
               "prev": [[2, lat, 10], [2, lat, 11]],
               "gen_src": sources, "tgt_lang_id": lat, "max_new_tokens": MAX_LEN + 1}
    (tmp_path / "request.json").write_text(json.dumps(request))
    hf_side.ask("check", grown.out, tmp_path / "request.json", tmp_path / "result.json")
    hf_side.answer()
    result = json.loads((tmp_path / "result.json").read_text())

    assert result["vocab_size"] == len(d) > json.loads(
        (grown.hub / "config.json").read_text())["vocab_size"]
    vocab = result["vocab"]
    assert vocab["lat_Latn"] == lat and vocab["xxx_Cyrl"] == d.index("__xxx_Cyrl__")
    record = json.loads((grown.data / GROWTH_FILE).read_text(encoding="utf-8"))
    assert all(vocab[piece] == row == d.index(piece) for piece, row in record["pieces"].items())
    # the tokenizer splits Latin as fairseq's data is split, new pieces included
    new_rows = set(record["pieces"].values())
    used = set()
    for text, ids in zip(latin, result["text_ids"]):
        assert ids == fairseq_ids(PAIR[1], text) + [d.eos()] and d.unk() not in ids
        used |= new_rows & set(ids)
    assert len(used) > 5
    assert result["texts_by_lang"][PAIR[0]] == sources

    model64 = as_float64(model)
    assert_logits_close(model, model64, request, result)
    generator64 = task.build_generator([model64], cfg.generation)
    same, distinct = 0, set()
    for i, (src, theirs) in enumerate(zip(sources, result["generated"])):
        # both in float64 (transformers' generate and fairseq's): the near-tie rule of
        # test_hf_nllb.assert_same_greedy_choices
        ours = greedy(task, generator64, model64, src)
        # HF: decoder start </s>, the forced new language, tokens; fairseq: the language (its
        # prefix), tokens, </s> (forced after MAX_LEN tokens)
        assert theirs[0] == 2 and ours[0] == theirs[1] == lat
        n = len(ours) if len(ours) <= MAX_LEN else MAX_LEN
        assert_same_greedy_choices(theirs[1:n + 1], ours[:n], greedy_gaps(model64, src, ours), i)
        same += theirs[1:n + 1] == ours[:n]
        distinct.add(tuple(ours))
        # and its text is SentencePiece's decoding of those pieces (without the tokenizer's
        # special tokens: fairseq's 4, the language codes, <mask>)
        pieces = [d[t] for t in theirs
                  if t >= d.nspecial and lang_of_token(d[t]) is None and d[t] != "<mask>"]
        assert result["decoded"][i] == sp.decode(pieces), (pieces, result["decoded"][i])
    print(f"{same} of {len(sources)} greedy translations alike, {len(distinct)} distinct")
    # the comparison compared (at least one whole translation: each sentence either matches or
    # differs first at a near-tie, which in float64 needs a gap below 2^-23 of the logits'
    # scale), and the outputs depend on the source
    assert same >= 1 and len(distinct) > 5


def test_lora_from_the_hub_directory_with_added_languages(grown):
    """--finetune-from-model HUB_DIR --lora-rank 4 --lora-train-new-rows --init-new-langs-from
    eng_Latn on the grown dictionary (docs/lora.md, "Adding a language with LoRA"): the
    embedding grows; every pretrained row and every other weight of the hub is kept bit for bit
    (the frozen base, saved once), while every added row trained, and so did every adapter."""
    from fairseq_fsdp2.checkpoint.export import lora_tensors
    from fairseq_fsdp2.checkpoint.grown_embedding import plan_rows
    from fairseq_fsdp2.hf.nllb_weights import FAIRSEQ_EMBEDDING, HFWeights
    from fairseq_fsdp2.options import new_lang_sources
    output = grown.lora_output
    assert "grew the shared embedding" in output
    assert "LoRA rank 4: 32 linear modules adapted" in output
    path = grown.lora_save / "checkpoint_last.pt"
    state = torch.load(path, weights_only=True)
    hub = HFWeights(str(grown.hub))
    rows = hub.shape(FAIRSEQ_EMBEDDING[0])[0]
    assert state["fsdp2"]["lora"]["pretrained_rows"] == rows
    tensors = lora_tensors(str(path), state)
    lines = (grown.data / "dict.txt").read_text(encoding="utf-8").splitlines()
    tokens = ["<s>", "<pad>", "</s>", "<unk>"] + [line.split(" ")[0] for line in lines]
    embedding = tensors[FAIRSEQ_EMBEDDING[0]]
    assert embedding.shape[0] == len(tokens) > rows
    for key in hub:
        value = hub[key]
        got = tensors[key][:rows] if key in FAIRSEQ_EMBEDDING else tensors[key]
        assert torch.equal(got, value), key
    # every added row trained (each takes part in the output projection's softmax) from where
    # the load put it (checkpoint/grown_embedding.py's rule: the language codes eng_Latn's row)
    start = plan_rows(tokens, rows, new_lang_sources("eng_Latn")).grow(
        hub[FAIRSEQ_EMBEDDING[0]])
    assert all(not torch.equal(embedding[r], start[r]) for r in range(rows, len(tokens)))
    trained = [k for k in tensors if k.endswith(".lora_B")]
    assert len(trained) == 32 and all(tensors[k].abs().sum() > 0 for k in trained)
