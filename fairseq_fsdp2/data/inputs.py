"""The raw input of data preparation: parallel text files named ``{split}.{src}-{tgt}.{lang}``
with NLLB language codes, checked before any work is done (prepare.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Sequence

from ..models.nllb_languages import LANG_CODE, NLLB200_LANGS

SPLITS = ("train", "valid", "test")
RAW_NAME = re.compile(
    r"^(?P<split>train|valid|test)\.(?P<src>[^.]+)-(?P<tgt>[^.]+)\.(?P<lang>[^.]+)$")


class PrepareError(Exception):
    """An input problem, reported as one line without a traceback."""


@dataclass(frozen=True)
class Pair:
    src: str
    tgt: str

    @property
    def name(self) -> str:
        return f"{self.src}-{self.tgt}"

    def raw(self, raw_dir: Path, split: str, lang: str) -> Path:
        return raw_dir / f"{split}.{self.name}.{lang}"


def check_code(code: str, where: str) -> None:
    """A well-formed NLLB-style language code (ISO 639-3 + '_' + ISO 15924 script)."""
    if not LANG_CODE.match(code):
        raise PrepareError(f"malformed language code {code!r} in {where}: expected an NLLB code "
                           "like eng_Latn (ISO 639-3 + '_' + ISO 15924 script)")


def check_lang(code: str, allow_non_nllb: bool, where: str,
               added: Collection[str] = ()) -> None:
    """A language the data may use: an NLLB-200 language, one being added (--add-langs), or
    any well-formed code with --allow-non-nllb-langs."""
    check_code(code, where)
    if code not in NLLB200_LANGS and code not in added and not allow_non_nllb:
        raise PrepareError(f"unknown language code {code!r} in {where}: not one of the 202 "
                           "NLLB-200 languages (add it to the model with --add-langs, or use "
                           "--allow-non-nllb-langs to accept it)")


def discover_pairs(raw_dir: Path, allow_non_nllb: bool, added: Collection[str] = ()) -> list[Pair]:
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
            check_lang(m[key], allow_non_nllb, path.name, added)
        if m["lang"] not in (m["src"], m["tgt"]):
            raise PrepareError(f"{path.name}: language {m['lang']} is not a side of the pair "
                               f"{m['src']}-{m['tgt']}")
        pairs.add(Pair(m["src"], m["tgt"]))
    return sorted(pairs, key=lambda p: p.name)


def parse_pairs(spec: str, allow_non_nllb: bool, added: Collection[str] = ()) -> list[Pair]:
    pairs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item.count("-") != 1:
            raise PrepareError(f"malformed language pair {item!r} in --lang-pairs: "
                               "expected SRC-TGT")
        src, tgt = item.split("-")
        for code in (src, tgt):
            check_lang(code, allow_non_nllb, "--lang-pairs", added)
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
