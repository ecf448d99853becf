"""Growing a pretrained model's vocabulary: data preparation (data/grown_vocab.py,
data/spm_model.py) from fairseq files, the rule the embedding grows by
(checkpoint/grown_embedding.py), --init-new-langs-from, and their one-line refusals.
The Hugging Face route: test_hf_add_langs.py; training on the grown rows:
test_grown_embedding.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from fairseq.data import Dictionary, data_utils

from fairseq_fsdp2.checkpoint.grown_embedding import dictionary_problem, plan_rows
from fairseq_fsdp2.data import numbers
from fairseq_fsdp2.data.growth_record import GROWTH_FILE
from fairseq_fsdp2.data.prepare import PrepareError, prepare, read_lines
from fairseq_fsdp2.data.spm_model import add_pieces, train_spm
from fairseq_fsdp2.errors import CheckpointError, OptionError
from fairseq_fsdp2.models.nllb_languages import NLLB200_LANGS
from fairseq_fsdp2.options import new_lang_sources

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]


def quiet(*args):
    pass


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A "pretrained" model's files: eng-fra numbers, a unigram SentencePiece model of 100
    pieces and the dictionary built from them; and English-Latin raw data to add."""
    root = tmp_path_factory.mktemp("add_langs")
    numbers.write_corpus(root / "raw_base", [("eng_Latn", "fra_Latn")], n_train=500, n_valid=0,
                         n_test=0, seed=4)
    prepare(root / "raw_base", root / "base", vocab_size=100, log=quiet)
    numbers.write_corpus(root / "raw", [("eng_Latn", "lat_Latn")], n_train=500, n_valid=20,
                         n_test=0, seed=5)
    return root


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_grown_dictionary_keeps_the_models_rows_then_adds_languages_pieces_padding(base):
    dest = prepare(base / "raw", base / "grown", spm_model=base / "base" / "spm.model",
                   dictionary=base / "base" / "dict.txt", add_langs="lat_Latn,yyy_Cyrl",
                   train_pieces=60, log=quiet)
    old, new = lines_of(base / "base" / "dict.txt"), lines_of(dest / "dict.txt")
    assert new[:len(old)] == old  # the model's rows, where they were
    assert new[len(old):len(old) + 2] == ["__lat_Latn__ 1", "__yyy_Cyrl__ 1"]
    record = json.loads((dest / GROWTH_FILE).read_text(encoding="utf-8"))
    pieces = list(record["pieces"])
    assert record["model_rows"] == len(old) + 4 and len(pieces) > 10
    assert [line.split()[0] for line in new[len(old) + 2:len(old) + 2 + len(pieces)]] == pieces
    # then pieces the model's SentencePiece model had but its dictionary (built from other
    # text) did not list, which the Latin text uses
    listed = list(record["listed"])
    was = spm.SentencePieceProcessor(model_file=str(base / "base" / "spm.model"))
    assert set(listed) <= {was.id_to_piece(i) for i in range(was.get_piece_size())}
    start = len(old) + 2 + len(pieces)
    assert [line.split()[0] for line in new[start:start + len(listed)]] == listed
    padding = new[start + len(listed):]
    assert len(new + SPECIALS) % 8 == 0 and len(padding) < 8  # as fairseq pads
    assert padding == [f"madeupword{i:04d} 0" for i in range(len(padding))]
    assert (dest / "langs.txt").read_text().strip() == "eng_Latn,fra_Latn,lat_Latn,yyy_Cyrl"
    # the pieces went into a copy of the model, after its pieces, with the scores the
    # unigram model trained on the Latin text gave them; Latin now takes fewer pieces
    now = spm.SentencePieceProcessor(model_file=str(dest / "spm.model"))
    n = was.get_piece_size()
    assert [now.id_to_piece(i) for i in range(n)] == [was.id_to_piece(i) for i in range(n)]
    assert [now.id_to_piece(i) for i in range(n, now.get_piece_size())] == pieces
    latin = read_lines(base / "raw" / "train.eng_Latn-lat_Latn.lat_Latn")
    before = sum(map(len, was.encode(latin, out_type=str)))
    after = sum(map(len, now.encode(latin, out_type=str)))
    assert after < 0.7 * before, (before, after)
    # and fairseq reads the Latin data with no unknown token, decoding it back
    d = Dictionary.load(str(dest / "dict.lat_Latn.txt"))
    data = data_utils.load_indexed_dataset(str(dest / "valid.eng_Latn-lat_Latn.lat_Latn"), d)
    raw = read_lines(base / "raw" / "valid.eng_Latn-lat_Latn.lat_Latn")
    for i in range(len(raw)):
        assert d.unk() not in data[i].tolist() and now.decode(d.string(data[i]).split()) == raw[i]


def test_nllb200_dictionary_grows_after_the_models_rows(base, tmp_path):
    """--dict-langs nllb200 appends NLLB's 202 languages; --model-rows keeps the rows up to the
    checkpoint's (NLLB-200's three beyond its dictionary and languages) before the new ones."""
    base_dict = base / "base" / "dict.txt"
    pieces = [line for line in lines_of(base_dict) if not line.startswith("__")]
    (tmp_path / "dict.txt").write_text("".join(line + "\n" for line in pieces))
    entries = 4 + len(pieces) + 202
    dest = prepare(base / "raw", tmp_path / "out", spm_model=base / "base" / "spm.model",
                   dictionary=tmp_path / "dict.txt", dict_langs="nllb200", add_langs="lat_Latn",
                   model_rows=entries + 3, padding_factor=1, log=quiet)
    tokens = SPECIALS + [line.split()[0] for line in lines_of(dest / "dict.txt")]
    assert tokens[4 + len(pieces):entries] == [f"__{c}__" for c in NLLB200_LANGS]
    assert tokens[entries:entries + 4] == \
        [f"madeupword{r:04d}" for r in range(entries, entries + 3)] + ["__lat_Latn__"]
    record = json.loads((dest / GROWTH_FILE).read_text(encoding="utf-8"))
    assert record["model_rows"] == entries + 3 and tokens[entries + 4:] == list(record["listed"])
    assert (dest / "langs.txt").read_text().strip().split(",") == \
        [*NLLB200_LANGS, "lat_Latn"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(add_langs="lat_Latn,fra_Latn"), "--add-langs fra_Latn: the model has that language "
                                          "already"),
    (dict(add_langs="lat"), "malformed language code 'lat' in --add-langs"),
    (dict(add_langs="yyy_Cyrl"), "unknown language code 'lat_Latn' in train.eng_Latn-lat_Latn."
                                 "eng_Latn: not one of the 202 NLLB-200 languages (add it to "
                                 "the model with --add-langs"),
    (dict(base_files=False), "--add-langs, --add-pieces and --train-pieces grow a pretrained "
                             "model's vocabulary: give the model's --hf-model DIR, or its "
                             "--spm-model and --dict"),
    (dict(model_rows=10), "--model-rows 10 is fewer than the dictionary's"),
    (dict(add_pieces="bad"), "bad.txt:1: expected a piece, or a piece and its score"),
    (dict(base_files=False, model_rows=400), "--model-rows applies to a model given by "
                                            "--spm-model and --dict"),
])
def test_bad_growth_stops_with_one_line_and_writes_nothing(base, tmp_path, kwargs, message):
    kwargs = {"add_langs": "lat_Latn", **kwargs}
    if kwargs.pop("base_files", True):
        kwargs.update(spm_model=base / "base" / "spm.model", dictionary=base / "base" / "dict.txt")
    if kwargs.get("add_pieces") == "bad":
        (tmp_path / "bad.txt").write_text("▁ab x y\n")
        kwargs["add_pieces"] = tmp_path / "bad.txt"
    with pytest.raises(PrepareError) as e:
        prepare(base / "raw", tmp_path / "out" / "bin", log=quiet, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


def test_pieces_for_a_bpe_model_must_be_producible(base, tmp_path):
    """SentencePiece's BPE makes a piece only by merging two pieces it has: a new piece with
    no such split is refused; with its parts added too it is taken, its score below every
    score of the model (its merges come after the model's)."""
    texts = read_lines(base / "raw_base" / "train.eng_Latn-fra_Latn.eng_Latn")
    model = train_spm(texts, tmp_path / "bpe", 100, "bpe", 10_000, seed=1)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    have = {sp.id_to_piece(i) for i in range(sp.get_piece_size())}
    word = "▁viginti"
    chain = [word[:k] for k in range(2, len(word) + 1) if word[:k] not in have]
    assert set(word) <= have and word in chain and "▁vigint" in chain  # a chain of merges
    with pytest.raises(PrepareError, match="could never produce the piece '▁viginti'"):
        add_pieces(model, [(word, None)], tmp_path / "out.model", "--add-pieces FILE")
    added = add_pieces(model, [(p, None) for p in chain + chain[:1]], tmp_path / "out.model",
                       "--add-pieces FILE")
    assert added == chain  # each once, in the order given
    grown = spm.SentencePieceProcessor(model_file=str(tmp_path / "out.model"))
    new_ids = range(100, grown.get_piece_size())
    assert [grown.id_to_piece(i) for i in new_ids] == chain
    assert max(grown.get_score(i) for i in new_ids) < min(sp.get_score(i) for i in range(3, 100))
    assert grown.encode("viginti", out_type=str) == [word]


def test_rows_grow_by_the_stated_rule():
    symbols = SPECIALS + ["__eng_Latn__", "__fra_Latn__", "a", "b", "__lat_Latn__",
                          "__yyy_Cyrl__", "c", "madeupword0000"]
    weight = torch.randn(8, 5)
    plan = plan_rows(symbols, 8, new_lang_sources("lat_Latn=fra_Latn"))
    grown = plan.grow(weight)
    assert torch.equal(grown[:8], weight)  # bit for bit
    assert torch.equal(grown[8], weight[5])  # __lat_Latn__ from __fra_Latn__
    mean = weight.double().mean(0)  # float64, rounded once to float32: within 2**-24
    assert all(((grown[r].double() - mean).abs() <= mean.abs() * 2 ** -24).all()
               for r in (9, 10, 11))
    assert plan.describe(symbols, "M") == (
        "grew the shared embedding of M from 8 to 12 rows for the dictionary's new entries "
        "(rows 8-11): __lat_Latn__ from the row of __fra_Latn__; 3 as the mean of the 8 "
        "pretrained rows; the pretrained rows are kept as they are")
    every = plan_rows(symbols, 8, new_lang_sources("eng_Latn")).grow(weight)
    assert torch.equal(every[8], weight[4]) and torch.equal(every[9], weight[4])
    for spec, message in (("deu_Latn", "deu_Latn is not a language of the pretrained model"),
                          ("eng_Latn=fra_Latn", "eng_Latn is not a new language of the "
                                                "dictionary (new: lat_Latn, yyy_Cyrl)")):
        with pytest.raises(CheckpointError, match=re.escape(message)):
            plan_rows(symbols, 8, new_lang_sources(spec))


def test_a_dictionary_that_does_not_extend_the_rows_is_refused(tmp_path):
    model = ["<s>", "<pad>", "</s>", "<unk>", "a", "b", "c"]
    assert dictionary_problem(model + ["d"], 7, "M", ("D", model), None) is None
    assert dictionary_problem(model[:6], 7, "M", None, None).startswith(
        "the dictionary has 6 entries, fewer than the 7 rows of the embedding of M")
    assert dictionary_problem(model[:4] + ["b", "a", "c", "d"], 7, "M", ("D", model), None) \
        .startswith("dictionary entry 4 is 'b', but row 4 of M is 'a' (its dictionary D)")
    (tmp_path / GROWTH_FILE).write_text(json.dumps({"model_rows": 6}))
    assert dictionary_problem(model + ["d"], 7, "M", None, str(tmp_path)).startswith(
        f"the data's dictionary was grown from a model of 6 rows ({tmp_path / GROWTH_FILE}), "
        f"but M has 7: prepare the data from this model (with --model-rows 7")


@pytest.mark.parametrize("spec, message", [
    ("eng", "'eng' is not a language code like eng_Latn"),
    ("eng_Latn,fra_Latn", "name one language for all new ones"),
    ("lat_Latn=eng_Latn,lat_Latn=fra_Latn", "name one language for all new ones"),
])
def test_init_new_langs_from_is_checked(spec, message):
    with pytest.raises(OptionError, match=message):
        new_lang_sources(spec)
