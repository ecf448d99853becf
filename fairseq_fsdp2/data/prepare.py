"""Turn raw parallel text into the binarized layout fairseq's ``translation_multi_simple_epoch``
task (the task NLLB-200 trains and fine-tunes with) reads.

Input, in RAW_DIR: one plain-text file per language pair, split and side, one sentence a line,
named ``{split}.{src}-{tgt}.{lang}`` (``train.eng_Latn-fra_Latn.eng_Latn``) with NLLB language
codes. ``train`` is required for every pair, ``valid`` and ``test`` are optional.

Steps: validate everything first (so a bad input fails in a second, not after encoding); train a
SentencePiece model on the training text unless ``--spm-model`` is given; encode; build a fairseq
dictionary from the encoded training text unless ``--dict`` is given, and append the language
tokens (``__eng_Latn__ 1``) at its end, where NLLB has them; binarize each pair with
``fairseq_cli.preprocess`` using that one dictionary on both sides.

Output, in DEST: ``{split}.{src}-{tgt}.{lang}.{bin,idx}``, ``dict.{lang}.txt`` for every language
of the data (copies of the one shared dictionary), ``dict.txt`` (the same), ``spm.model``,
``langs.txt`` and ``lang_pairs.txt`` (comma-separated, ready for ``--langs`` and
``--lang-pairs``). With ``--hf-model DIR`` (Hugging Face NLLB weights) the SentencePiece model
and the dictionary come from DIR: every token on the row HF's tokenizer gives it, the model's
languages in its order (hf/vocab.py). Everything is written into a temporary directory
next to DEST and renamed at the end, so a failed run leaves no half-written DEST behind.

Errors are one line on stderr starting ``prepare_data: error:``, with a non-zero exit status.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import sentencepiece as spm

from ..hf.vocab import dictionary_for
from ..models.nllb_languages import NLLB200_LANGS
from .preprocess import PreprocessError, run_preprocess

SPLITS = ("train", "valid", "test")
LANG_CODE = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")
RAW_NAME = re.compile(
    r"^(?P<split>train|valid|test)\.(?P<src>[^.]+)-(?P<tgt>[^.]+)\.(?P<lang>[^.]+)$")
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")



class PrepareError(Exception):
    """An input problem, reported as one line without a traceback."""


def lang_token(lang: str) -> str:
    """The token translation_multi_simple_epoch uses for a language (its default
    ``--lang-tok-style multilingual``)."""
    return f"__{lang}__"


@dataclass(frozen=True)
class Pair:
    src: str
    tgt: str

    @property
    def name(self) -> str:
        return f"{self.src}-{self.tgt}"

    def raw(self, raw_dir: Path, split: str, lang: str) -> Path:
        return raw_dir / f"{split}.{self.name}.{lang}"


def check_lang(code: str, allow_non_nllb: bool, where: str) -> None:
    if not LANG_CODE.match(code):
        raise PrepareError(f"malformed language code {code!r} in {where}: expected an NLLB code "
                           "like eng_Latn (ISO 639-3 + '_' + ISO 15924 script)")
    if code not in NLLB200_LANGS and not allow_non_nllb:
        raise PrepareError(f"unknown language code {code!r} in {where}: not one of the 202 "
                           "NLLB-200 languages (use --allow-non-nllb-langs to accept it)")


def discover_pairs(raw_dir: Path, allow_non_nllb: bool) -> list[Pair]:
    """Language pairs named by the ``{split}.{src}-{tgt}.{lang}`` files in raw_dir, sorted."""
    pairs = set()
    for path in sorted(raw_dir.iterdir()):
        if path.name.startswith(".") or not path.name.startswith(tuple(s + "." for s in SPLITS)):
            continue
        m = RAW_NAME.match(path.name)
        if not m:
            raise PrepareError(f"unexpected file name {path.name!r} in {raw_dir}: expected "
                               "{split}.{src}-{tgt}.{lang}, e.g. train.eng_Latn-fra_Latn.eng_Latn")
        for key in ("src", "tgt", "lang"):
            check_lang(m[key], allow_non_nllb, path.name)
        if m["lang"] not in (m["src"], m["tgt"]):
            raise PrepareError(f"{path.name}: language {m['lang']} is not a side of the pair "
                               f"{m['src']}-{m['tgt']}")
        pairs.add(Pair(m["src"], m["tgt"]))
    return sorted(pairs, key=lambda p: p.name)


def parse_pairs(spec: str, allow_non_nllb: bool) -> list[Pair]:
    pairs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item.count("-") != 1:
            raise PrepareError(f"malformed language pair {item!r} in --lang-pairs: "
                               "expected SRC-TGT")
        src, tgt = item.split("-")
        for code in (src, tgt):
            check_lang(code, allow_non_nllb, "--lang-pairs")
        pairs.append(Pair(src, tgt))
    if not pairs:
        raise PrepareError("--lang-pairs is empty")
    return pairs


def count_lines(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for _ in f)
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def plan_splits(raw_dir: Path, pairs: Sequence[Pair]) -> dict[tuple[Pair, str], int]:
    """Check every pair's files: train present, valid/test both sides or neither, equal line
    counts; returns {(pair, split): lines} for the splits present."""
    plan = {}
    for pair in pairs:
        if pair.src == pair.tgt:
            raise PrepareError(f"language pair {pair.name} has the same language on both sides")
        for split in SPLITS:
            paths = [pair.raw(raw_dir, split, lang) for lang in (pair.src, pair.tgt)]
            present = [p.is_file() for p in paths]
            if not any(present) and split != "train":
                continue
            for path, ok in zip(paths, present):
                if not ok:
                    raise PrepareError(f"missing file {path}")
            counts = [count_lines(p) for p in paths]
            if counts[0] != counts[1]:
                raise PrepareError(f"line counts differ for {split} {pair.name}: "
                                   f"{paths[0].name} has {counts[0]}, "
                                   f"{paths[1].name} has {counts[1]}")
            if split == "train" and counts[0] == 0:
                raise PrepareError(f"{paths[0]} is empty")
            plan[(pair, split)] = counts[0]
    return plan


def read_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def train_spm(texts: list[str], prefix: Path, vocab_size: int, model_type: str,
              max_sentences: int, seed: int) -> Path:
    """Train a SentencePiece model on (a deterministic sample of at most max_sentences of)
    texts. One thread and no internal sampling or shuffling, so the same input gives the same
    model."""
    texts = [t for t in texts if t.strip()]
    if len(texts) > max_sentences:
        texts = random.Random(seed).sample(texts, max_sentences)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=vocab_size,
            model_type=model_type, character_coverage=1.0, num_threads=1,
            input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2)
    except RuntimeError as e:  # e.g. "Vocabulary size too high (500). Please set it to ..."
        reason = re.sub(r"^.*\] *", "", " ".join(str(e).split()))  # drop the C++ location
        raise PrepareError(f"SentencePiece training failed: {reason}") from None
    return prefix.with_suffix(".model")


def read_dict_tokens(path: Path) -> list[str]:
    """Tokens of a fairseq dictionary file (``token count [#fairseq:overwrite]`` lines)."""
    tokens = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            fields = line.rstrip("\n").split(" ")
            if fields[-1] == "#fairseq:overwrite":
                fields = fields[:-1]
            if len(fields) != 2 or not fields[0] or not fields[1].lstrip("-").isdigit():
                raise PrepareError(f"{path}:{number}: not a fairseq dictionary line "
                                   "('<token> <count>')")
            tokens.append(fields[0])
    return tokens


def build_dictionary(encoded_train: Sequence[Path], append_langs: Sequence[str],
                     base: Optional[Path]) -> list[str]:
    """Lines of the shared dictionary: base's lines (or the encoded training pieces, most
    frequent first, ties by piece), then ``__lang__ 1`` for each language not yet in it."""
    if base is not None:
        with open(base, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
        present = set(read_dict_tokens(base))
    else:
        counts = Counter()
        for path in encoded_train:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    counts.update(line.split())
        for token in (*FAIRSEQ_SPECIALS, *map(lang_token, append_langs)):
            counts.pop(token, None)
        lines = [f"{tok} {n}" for tok, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        present = set(counts)
    lines += [f"{lang_token(lang)} 1" for lang in append_langs if lang_token(lang) not in present]
    return lines


def binarize(pair: Pair, splits: Sequence[str], encoded_dir: Path, dictionary: Path,
             out_dir: Path, workers: int) -> None:
    """One fairseq-preprocess run for a pair, the shared dictionary on both sides."""
    argv = ["--source-lang", pair.src, "--target-lang", pair.tgt,
            "--srcdict", str(dictionary), "--tgtdict", str(dictionary),
            "--destdir", str(out_dir), "--workers", str(workers), "--dataset-impl", "mmap"]
    for split in splits:
        argv += [f"--{split}pref", str(encoded_dir / f"{split}.{pair.name}")]
    try:
        run_preprocess(argv)
    except PreprocessError as exc:
        raise PrepareError(f"fairseq-preprocess failed for {pair.name}: {exc}") from None


def prepare(raw_dir: Path, dest: Path, *, lang_pairs: Optional[str] = None,
            spm_model: Optional[Path] = None, vocab_size: int = 8000,
            spm_type: str = "unigram", spm_max_sentences: int = 1_000_000,
            dictionary: Optional[Path] = None, dict_langs: str = "data",
            allow_non_nllb_langs: bool = False, workers: int = 1, overwrite: bool = False,
            seed: int = 1, hf_model: Optional[Path] = None, log=print) -> Path:
    """Validate, encode and binarize raw_dir into dest (see the module docstring)."""
    raw_dir, dest = Path(raw_dir), Path(dest)
    if not raw_dir.is_dir():
        raise PrepareError(f"raw data directory {raw_dir} does not exist")
    if dest.exists() and not dest.is_dir():
        raise PrepareError(f"destination {dest} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise PrepareError(f"destination {dest} exists and is not empty (use --overwrite)")
    for name, path in (("--spm-model", spm_model), ("--dict", dictionary)):
        if path is not None and not Path(path).is_file():
            raise PrepareError(f"{name} file {path} does not exist")
    if dictionary is not None:
        read_dict_tokens(Path(dictionary))
    hf_lines = None
    if hf_model is not None:
        if spm_model is not None or dictionary is not None:
            raise PrepareError("--hf-model brings its own SentencePiece model and dictionary: "
                               "leave out --spm-model and --dict")
        try:
            spm_model, hf_lines, hf_langs = dictionary_for(Path(hf_model))
        except ValueError as e:
            raise PrepareError(f"--hf-model: {e}") from None

    pairs = (parse_pairs(lang_pairs, allow_non_nllb_langs) if lang_pairs
             else discover_pairs(raw_dir, allow_non_nllb_langs))
    if not pairs:
        raise PrepareError(f"no {{split}}.{{src}}-{{tgt}}.{{lang}} files in {raw_dir}")
    plan = plan_splits(raw_dir, pairs)
    langs = sorted({lang for p in pairs for lang in (p.src, p.tgt)})
    # language tokens for the dictionary, in this order; also written to langs.txt
    append_langs = langs if dict_langs == "data" else \
        list(NLLB200_LANGS) + [lang for lang in langs if lang not in NLLB200_LANGS]
    if hf_lines is not None:
        missing = [lang for lang in langs if lang not in hf_langs]
        if missing:
            raise PrepareError(f"language {missing[0]} is not in the tokenizer of {hf_model}")
        append_langs = hf_langs

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        work = tmp / "_work"
        (work / "encoded").mkdir(parents=True)
        if spm_model is None:
            train_text = [line for (pair, split) in plan if split == "train"
                          for lang in (pair.src, pair.tgt)
                          for line in read_lines(pair.raw(raw_dir, split, lang))]
            log(f"training a {spm_type} SentencePiece model, vocab {vocab_size}, "
                f"on {len(train_text)} lines")
            model = train_spm(train_text, work / "spm", vocab_size, spm_type,
                              spm_max_sentences, seed)
        else:
            model = Path(spm_model)
        try:
            sp = spm.SentencePieceProcessor(model_file=str(model))
        except (OSError, RuntimeError) as e:
            raise PrepareError(f"cannot load SentencePiece model {model}: {e}") from None

        encoded_train = []
        for (pair, split), n in plan.items():
            for lang in (pair.src, pair.tgt):
                out = work / "encoded" / f"{split}.{pair.name}.{lang}"
                pieces = sp.encode(read_lines(pair.raw(raw_dir, split, lang)), out_type=str)
                out.write_text("".join(" ".join(p) + "\n" for p in pieces), encoding="utf-8")
                if split == "train":
                    encoded_train.append(out)
            log(f"encoded {split} {pair.name}: {n} lines")

        dict_lines = hf_lines or build_dictionary(encoded_train, append_langs,
                                                  Path(dictionary) if dictionary else None)
        dict_path = tmp / "dict.txt"
        dict_path.write_text("".join(line + "\n" for line in dict_lines), encoding="utf-8")
        log(f"dictionary: {len(dict_lines) + len(FAIRSEQ_SPECIALS)} entries "
            f"(with {len(FAIRSEQ_SPECIALS)} specials and language tokens)")

        for pair in pairs:
            splits = [s for s in SPLITS if (pair, s) in plan]
            binarize(pair, splits, work / "encoded", dict_path, tmp, workers)
            log(f"binarized {pair.name}: {', '.join(splits)}")

        for lang in langs:  # identical copies: the task loads one dictionary per language
            shutil.copyfile(dict_path, tmp / f"dict.{lang}.txt")
        shutil.copyfile(model, tmp / "spm.model")
        (tmp / "langs.txt").write_text(",".join(append_langs) + "\n")
        (tmp / "lang_pairs.txt").write_text(",".join(p.name for p in pairs) + "\n")
        shutil.rmtree(work)

        # Swap in: the old DEST (empty, or replaced with --overwrite) goes only once all is done.
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
            os.replace(tmp, dest)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    log(f"wrote {dest}")
    return dest


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_fsdp2.data.prepare",
        description="Encode and binarize raw parallel text for translation_multi_simple_epoch.")
    parser.add_argument("raw_dir", type=Path, help="files named {split}.{src}-{tgt}.{lang}")
    parser.add_argument("dest", type=Path, help="output directory (must not exist or be empty)")
    parser.add_argument("--lang-pairs", help="comma-separated SRC-TGT pairs to prepare "
                        "(default: every pair found in RAW_DIR)")
    parser.add_argument("--spm-model", type=Path,
                        help="existing SentencePiece model (default: train one)")
    parser.add_argument("--vocab-size", type=int, default=8000,
                        help="size of the SentencePiece model to train")
    parser.add_argument("--spm-type", choices=("unigram", "bpe"), default="unigram")
    parser.add_argument("--spm-max-sentences", type=int, default=1_000_000,
                        help="train SentencePiece on at most this many training lines")
    parser.add_argument("--dict", type=Path, dest="dictionary",
                        help="existing fairseq dictionary (default: built from the data)")
    parser.add_argument("--dict-langs", choices=("data", "nllb200"), default="data",
                        help="language tokens appended to the dictionary: the data's languages, "
                        "or all 202 NLLB-200 languages in NLLB's order (as the NLLB-200 "
                        "checkpoints expect, with the NLLB --spm-model and --dict)")
    parser.add_argument("--hf-model", type=Path,
                        help="a Hugging Face NLLB model directory (config.json, "
                        "sentencepiece.bpe.model, tokenizer files): encode with its "
                        "SentencePiece model and write the dictionary that puts every token "
                        "on the embedding row of its tokenizer, for --finetune-from-model DIR")
    parser.add_argument("--allow-non-nllb-langs", action="store_true",
                        help="accept well-formed codes that are not NLLB-200 languages")
    parser.add_argument("--workers", type=int, default=1, help="fairseq-preprocess workers")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DEST")
    parser.add_argument("--quiet", action="store_true")
    args = vars(parser.parse_args(argv))
    quiet = args.pop("quiet")
    try:
        prepare(**args, log=(lambda *a: None) if quiet else print)
    except PrepareError as e:
        raise SystemExit(f"prepare_data: error: {e}") from None


if __name__ == "__main__":
    main()
