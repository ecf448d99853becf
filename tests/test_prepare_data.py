"""Data preparation: the numbers corpus, prepare.py's output layout and round trip, a real
fairseq-train run of translation_multi_simple_epoch on it, and one-line errors that leave
nothing behind."""
from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import sentencepiece as spm
from fairseq.data import Dictionary, data_utils

from launcher import run_command

from fairseq_fsdp2.data import numbers
from fairseq_fsdp2.data.prepare import main, read_lines, train_spm
from fairseq_fsdp2.models.nllb_languages import NLLB200_LANGS

REPO = Path(__file__).resolve().parent.parent
PAIR = ("eng_Latn", "fra_Latn")
LANGS = sorted(PAIR)


def run_main(*argv) -> int:
    return main([str(a) for a in argv] + ["--quiet"])


def error_of(*argv) -> str:
    """The one line a failing run prints to stderr (its exit status then 2)."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        status = run_main(*argv)
    assert status == 2, status
    message = err.getvalue()
    assert message.startswith("prepare_data: error: ") and message.count("\n") == 1, message
    return message.rstrip("\n")


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw")
    numbers.write_corpus(raw, [PAIR], n_train=600, n_valid=30, n_test=30, seed=3)
    return raw


@pytest.fixture(scope="module")
def prepared(raw, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("out") / "bin"
    run_main(raw, dest, "--vocab-size", 300, "--spm-type", "bpe")
    return dest


# --- the numbers corpus --------------------------------------------------------------------

@pytest.mark.parametrize("n,eng,fra,deu,spa", [
    (0, "zero", "zéro", "null", "cero"),
    (21, "twenty-one", "vingt et un", "einundzwanzig", "veintiuno"),
    (71, "seventy-one", "soixante et onze", "einundsiebzig", "setenta y uno"),
    (80, "eighty", "quatre-vingts", "achtzig", "ochenta"),
    (97, "ninety-seven", "quatre-vingt-dix-sept", "siebenundneunzig", "noventa y siete"),
    (100, "one hundred", "cent", "einhundert", "cien"),
    (101, "one hundred one", "cent un", "einhunderteins", "ciento uno"),
    (200, "two hundred", "deux cents", "zweihundert", "doscientos"),
    (581, "five hundred eighty-one", "cinq cent quatre-vingt-un", "fünfhunderteinundachtzig",
     "quinientos ochenta y uno"),
    (1000, "one thousand", "mille", "eintausend", "mil"),
    (2016, "two thousand sixteen", "deux mille seize", "zweitausendsechzehn", "dos mil dieciséis"),
    (9999, "nine thousand nine hundred ninety-nine", "neuf mille neuf cent quatre-vingt-dix-neuf",
     "neuntausendneunhundertneunundneunzig", "nueve mil novecientos noventa y nueve"),
])
def test_number_words(n, eng, fra, deu, spa):
    assert [numbers.NUMBER_WORDS[lang](n) for lang in
            ("eng_Latn", "fra_Latn", "deu_Latn", "spa_Latn")] == [eng, fra, deu, spa]


def test_numbers_corpus_is_deterministic_and_held_out(tmp_path):
    pairs = [("eng_Latn", "fra_Latn"), ("eng_Latn", "deu_Latn")]
    first = numbers.write_corpus(tmp_path / "a", pairs, n_train=300, n_valid=20, n_test=20)
    second = numbers.write_corpus(tmp_path / "b", pairs, n_train=300, n_valid=20, n_test=20)
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]

    words = {numbers.english(n): n for n in range(numbers.MAX_NUMBER + 1)}

    def used(split, pair):  # the numbers behind the English side of a split
        path = tmp_path / "a" / f"{split}.{pair[0]}-{pair[1]}.eng_Latn"
        lines = path.read_text().splitlines()
        for prefix in ("the number ", "page "):
            lines = [line.removeprefix(prefix) for line in lines]
        return {words[line] for line in lines}

    for pair in pairs:
        train, valid, test = (used(s, pair) for s in ("train", "valid", "test"))
        assert len(valid) == len(test) == 20 and not valid & test
        assert not (valid | test) & train
    # held out for every pair: no held-out number reaches training through another pair
    assert used("valid", pairs[0]) == used("valid", pairs[1])


# --- prepare.py ----------------------------------------------------------------------------

def test_layout_and_dictionary(prepared):
    for split in ("train", "valid", "test"):
        for lang in PAIR:
            for ext in ("bin", "idx"):
                assert (prepared / f"{split}.eng_Latn-fra_Latn.{lang}.{ext}").stat().st_size > 0
    shared = (prepared / "dict.txt").read_text(encoding="utf-8")
    for lang in LANGS:
        assert (prepared / f"dict.{lang}.txt").read_text(encoding="utf-8") == shared
    lines = shared.splitlines()
    assert lines[-2:] == ["__eng_Latn__ 1", "__fra_Latn__ 1"]
    assert not any(line.startswith("__") for line in lines[:-2])
    sp = spm.SentencePieceProcessor(model_file=str(prepared / "spm.model"))
    pieces = {sp.id_to_piece(i) for i in range(sp.get_piece_size())}
    tokens = [line.split(" ")[0] for line in lines[:-2]]
    assert len(set(tokens)) == len(tokens) > 50 and set(tokens) <= pieces
    assert (prepared / "langs.txt").read_text() == "eng_Latn,fra_Latn\n"
    assert (prepared / "lang_pairs.txt").read_text() == "eng_Latn-fra_Latn\n"
    assert not list(prepared.glob("_work*")) and not leftovers(prepared.parent)


def test_sentencepiece_training_is_deterministic(raw, tmp_path):
    text = [line for lang in PAIR for line in read_lines(raw / f"train.eng_Latn-fra_Latn.{lang}")]
    vocabs = []
    for name in ("a", "b"):  # the files differ only in the model_prefix they record
        sp = spm.SentencePieceProcessor(
            model_file=str(train_spm(text, tmp_path / name, 100, "unigram", 500, seed=1)))
        vocabs.append([(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())])
    assert len(vocabs[0]) == 100 and vocabs[0] == vocabs[1]


def test_binarized_text_round_trips(raw, prepared):
    """What fairseq reads back from the .bin/.idx files decodes to the raw sentences."""
    dictionary = Dictionary.load(str(prepared / "dict.fra_Latn.txt"))
    sp = spm.SentencePieceProcessor(model_file=str(prepared / "spm.model"))
    for split in ("train", "test"):
        dataset = data_utils.load_indexed_dataset(
            str(prepared / f"{split}.eng_Latn-fra_Latn.fra_Latn"), dictionary)
        raw_lines = (raw / f"{split}.eng_Latn-fra_Latn.fra_Latn").read_text().splitlines()
        assert len(dataset) == len(raw_lines)
        for i in (0, len(raw_lines) - 1):
            tokens = dataset[i]
            assert tokens[-1] == dictionary.eos() and dictionary.unk() not in tokens.tolist()
            pieces = dictionary.string(tokens).split()
            assert sp.decode(pieces) == raw_lines[i]


def test_fairseq_trains_on_it(prepared):
    langs = (prepared / "langs.txt").read_text().strip()
    # fairseq-train's module (the console script calls its cli_main), forked from the tests'
    # pre-imported server: a fresh interpreter would add seconds of imports and prove nothing more
    proc = run_command(
        "fairseq_cli.train", prepared,
        "--task", "translation_multi_simple_epoch", "--lang-pairs", "eng_Latn-fra_Latn",
        "--langs", langs, "--encoder-langtok", "src", "--decoder-langtok",
        "--arch", "transformer_nllb_tiny", "--user-dir", REPO / "fairseq_fsdp2", "--cpu",
        "--max-tokens", "1000", "--max-update", "2", "--optimizer", "adam", "--lr", "1e-3",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--no-save", "--disable-validation", "--no-progress-bar", "--num-workers", "0",
        timeout=180)
    out = proc.output
    assert proc.returncode == 0, out[-3000:]
    assert "num_updates 2" in out
    # the task found every language token already in the dictionary and added none
    n_types = len((prepared / "dict.txt").read_text().splitlines()) + 4
    assert f"[eng_Latn] dictionary: {n_types} types" in out
    assert f"Embedding({n_types}, 64, padding_idx=1)" in out


def test_reuse_model_and_dictionary_with_overwrite(raw, prepared, tmp_path):
    """--spm-model and --dict reproduce the first run's files; --overwrite replaces DEST."""
    dest = tmp_path / "again"
    dest.mkdir()
    (dest / "stale").write_text("x")
    assert "exists and is not empty" in error_of(raw, dest, "--vocab-size", 300)
    run_main(raw, dest, "--spm-model", prepared / "spm.model", "--dict", prepared / "dict.txt",
             "--overwrite")
    assert not (dest / "stale").exists()
    for name in ("dict.txt", "dict.eng_Latn.txt", "train.eng_Latn-fra_Latn.eng_Latn.bin",
                 "valid.eng_Latn-fra_Latn.fra_Latn.idx"):
        assert (dest / name).read_bytes() == (prepared / name).read_bytes(), name
    assert not leftovers(tmp_path)


def test_nllb200_language_tokens(raw, prepared, tmp_path):
    dest = tmp_path / "nllb"
    run_main(raw, dest, "--spm-model", prepared / "spm.model", "--dict-langs", "nllb200")
    lines = (dest / "dict.txt").read_text().splitlines()
    assert lines[-202:] == [f"__{lang}__ 1" for lang in NLLB200_LANGS]
    assert (dest / "langs.txt").read_text().strip().split(",") == list(NLLB200_LANGS)


def test_model_rows_pad_the_dictionary_to_the_checkpoints_rows(raw, prepared, tmp_path):
    """NLLB-200's fairseq checkpoints have 3 rows more than its dictionary.txt with the 202
    languages (fairseq#4557): --model-rows pads with fairseq's fillers to exactly that many
    entries, after the language tokens; fewer rows than entries stop with one line."""
    dest = tmp_path / "rows"
    run_main(raw, dest, "--spm-model", prepared / "spm.model", "--dict", prepared / "dict.txt",
             "--dict-langs", "nllb200")
    plain = (dest / "dict.txt").read_text().splitlines()
    rows = len(plain) + 4 + 3  # fairseq's 4 specials, then 3 rows the checkpoint has more
    padded_dest = tmp_path / "padded"
    run_main(raw, padded_dest, "--spm-model", prepared / "spm.model", "--dict",
             prepared / "dict.txt", "--dict-langs", "nllb200", "--model-rows", rows)
    padded = (padded_dest / "dict.txt").read_text().splitlines()
    assert padded[:len(plain)] == plain and len(padded) + 4 == rows
    assert padded[len(plain):] == [f"madeupword{r:04d} 0" for r in range(rows - 3, rows)]
    message = error_of(raw, tmp_path / "few", "--spm-model", prepared / "spm.model", "--dict",
                       prepared / "dict.txt", "--dict-langs", "nllb200", "--model-rows", 10)
    assert f"--model-rows 10 is fewer than the dictionary's {len(plain) + 4} entries" in message
    assert not (tmp_path / "few").exists() and not leftovers(tmp_path)


# --- errors --------------------------------------------------------------------------------

def corrupt(raw: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    edit(copy)
    return copy


@pytest.mark.parametrize("edit,expected", [
    (lambda d: (d / "train.eng_Latn-fra_Latn.fra_Latn").unlink(),
     "missing file .*train.eng_Latn-fra_Latn.fra_Latn"),
    (lambda d: (d / "valid.eng_Latn-fra_Latn.eng_Latn").unlink(),
     "missing file .*valid.eng_Latn-fra_Latn.eng_Latn"),
    (lambda d: (d / "test.eng_Latn-fra_Latn.eng_Latn").write_text("one\ntwo\n"),
     "line counts differ for test eng_Latn-fra_Latn: .* has 2, .* has 30"),
    (lambda d: (d / "train.en-fr.en").write_text("x\n"), "malformed language code 'en'"),
    (lambda d: (d / "train.eng_Latn-xyz_Latn.xyz_Latn").write_text("x\n"),
     "unknown language code 'xyz_Latn'"),
    (lambda d: (d / "train.eng_Latn-fra_Latn.en").write_text("x\n"),
     "malformed language code 'en'"),
    (lambda d: [p.unlink() for p in d.iterdir()], "no .* files in"),
])
def test_input_errors(raw, tmp_path, edit, expected):
    bad = corrupt(raw, tmp_path, edit)
    dest = tmp_path / "out" / "bin"
    message = error_of(bad, dest, "--vocab-size", 300)
    assert re.search(expected, message), message
    assert not dest.parent.exists()  # input is checked before anything is written


def test_argument_errors(raw, tmp_path):
    dest = tmp_path / "bin"
    assert "malformed language pair 'eng_Latn'" in error_of(raw, dest, "--lang-pairs", "eng_Latn")
    assert "malformed language code 'xx_Latn'" in error_of(
        raw, dest, "--lang-pairs", "eng_Latn-xx_Latn")
    assert "unknown language code 'abc_Latn'" in error_of(
        raw, dest, "--lang-pairs", "eng_Latn-abc_Latn")
    assert "--spm-model file" in error_of(raw, dest, "--spm-model", tmp_path / "nope.model")
    (tmp_path / "bad.dict").write_text("token\n")
    assert "not a fairseq dictionary line" in error_of(raw, dest, "--dict", tmp_path / "bad.dict")
    assert not dest.exists() and not leftovers(tmp_path)


def test_failure_after_work_started_leaves_nothing(raw, tmp_path):
    """A SentencePiece failure happens inside the temporary directory: it is removed, and an
    existing DEST given with --overwrite is left as it was."""
    dest = tmp_path / "bin"
    dest.mkdir()
    (dest / "keep").write_text("old")
    message = error_of(raw, dest, "--vocab-size", 100000, "--overwrite")
    assert "SentencePiece training failed: Vocabulary size too high" in message
    assert [p.name for p in dest.iterdir()] == ["keep"] and not leftovers(tmp_path)


def test_cli_error_is_one_line_and_nonzero(raw, tmp_path):
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "x").write_text("")
    proc = subprocess.run([str(REPO / "scripts" / "prepare_data.sh"), str(raw),
                           str(tmp_path / "dest")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("prepare_data:")]
    assert errors == [f"prepare_data: error: destination {tmp_path / 'dest'} exists and is not "
                      "empty (use --overwrite)"]
