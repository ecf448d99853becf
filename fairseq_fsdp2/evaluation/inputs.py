"""What is evaluated: a test set's directions, checked before any model is read.

The data is a directory written by ``scripts/prepare_data.sh`` (DATA: ``dict.txt``,
``spm.model``, ``langs.txt``, ``lang_pairs.txt`` and the binarized ``{split}.{src}-{tgt}.*``
files); a direction ``src-tgt`` is there when the pair's files are, in either order (fairseq's
``translation_multi_simple_epoch`` reads a pair's files both ways). Its sources and references
are the binarized split, as ``fairseq-generate`` reads them. With a raw directory (``--raw``,
the files data preparation reads: ``{split}.{src}-{tgt}.{lang}``, one sentence a line) the
sources and references are those text files instead: the references as written, which is how
NLLB scores (against the FLORES-200 text files), and DATA gives the SentencePiece model, the
dictionary and the language tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..errors import OptionError
from ..data.inputs import Pair as Direction  # a direction is the data's language pair
from ..models.nllb_languages import LANG_CODE, NLLB200_LANGS

#: what prepare_data.sh writes into DATA and the evaluation reads
DATA_FILES = ("dict.txt", "spm.model", "langs.txt", "lang_pairs.txt")


@dataclass(frozen=True)
class TestSet:
    """The checked input: DATA, its split, the directions to translate (in the order given)."""

    data: Path
    split: str
    directions: tuple[Direction, ...]
    langs: tuple[str, ...]  # DATA/langs.txt: the task's --langs (the language tokens' order)
    lang_pairs: tuple[str, ...]  # DATA/lang_pairs.txt: the task's --lang-pairs
    raw: Optional[Path] = None

    @property
    def spm_model(self) -> Path:
        return self.data / "spm.model"

    @property
    def dictionary(self) -> Path:
        return self.data / "dict.txt"

    def raw_file(self, direction: Direction, lang: str) -> Path:
        """The raw text of ``lang`` for ``direction`` (the pair's file in either order)."""
        path = pair_file(self.raw, self.split, direction, lang)
        if path is not None:
            return path
        raise OptionError(f"{self.raw} has no {self.split}.{direction.name}.{lang}")

    def raw_lines(self, direction: Direction, lang: str) -> list[str]:
        text = self.raw_file(direction, lang).read_text(encoding="utf-8")
        return text.rstrip("\n").split("\n") if text.strip("\n") else []


def parse_direction(text: str) -> Direction:
    src, sep, tgt = text.strip().partition("-")
    if not sep or not src or not tgt or "-" in tgt:
        raise OptionError(f"bad direction {text!r}: expected SRC-TGT, e.g. eng_Latn-fra_Latn")
    return Direction(src, tgt)


def listed(path: Path) -> tuple[str, ...]:
    return tuple(x for x in path.read_text(encoding="utf-8").strip().split(",") if x)


def pair_file(folder: Path, split: str, d: Direction, lang: str,
              suffix: str = "") -> Optional[Path]:
    """``folder``'s file of ``lang`` for direction ``d``: ``{split}.{src}-{tgt}.{lang}{suffix}``,
    else the reverse pair's (one pair's files serve both directions), else None."""
    for a, b in ((d.src, d.tgt), (d.tgt, d.src)):
        path = folder / f"{split}.{a}-{b}.{lang}{suffix}"
        if path.is_file():
            return path
    return None


def _binarized(data: Path, split: str, d: Direction) -> bool:
    return pair_file(data, split, d, d.src, ".bin") is not None


def _raw_present(raw: Path, split: str, d: Direction) -> bool:
    return any(all((raw / f"{split}.{a}-{b}.{lang}").is_file() for lang in (d.src, d.tgt))
               for a, b in ((d.src, d.tgt), (d.tgt, d.src)))


def check_lang(code: str, langs: Sequence[str], data: Path) -> None:
    """A language the model can be asked for: NLLB's (or one added to the data), whose token
    DATA's dictionary has."""
    if not LANG_CODE.match(code):
        raise OptionError(f"malformed language code {code!r}: expected an NLLB code like "
                          f"eng_Latn (ISO 639-3 + '_' + ISO 15924 script)")
    if code not in langs:
        if code not in NLLB200_LANGS:
            raise OptionError(f"unknown language code {code!r}: not one of the 202 NLLB-200 "
                              f"languages, nor a language of {data}/langs.txt")
        raise OptionError(f"language {code} has no token in {data}'s dictionary (its "
                          f"langs.txt): prepare the data with it")


def test_set(data: Path, split: str = "test", directions: Optional[Sequence[str]] = None,
             raw: Optional[Path] = None) -> TestSet:
    """The checked test set; OptionError names the first problem."""
    data = Path(data)
    if not data.is_dir():
        raise OptionError(f"data directory {data} does not exist")
    for name in DATA_FILES:
        if not (data / name).is_file():
            raise OptionError(f"{data} has no {name}: not a directory written by "
                              f"scripts/prepare_data.sh")
    if raw is not None and not Path(raw).is_dir():
        raise OptionError(f"raw text directory {raw} does not exist")
    langs, lang_pairs = listed(data / "langs.txt"), listed(data / "lang_pairs.txt")
    if directions:
        chosen = [parse_direction(d) for d in directions]
    else:  # every direction the data was prepared with that has the split
        chosen = [parse_direction(p) for p in lang_pairs]
        chosen = [d for d in chosen if (_raw_present(Path(raw), split, d) if raw is not None
                                        else _binarized(data, split, d))]
        if not chosen:
            raise OptionError(f"{raw or data} has no {split} set of any of its language pairs "
                              f"({', '.join(lang_pairs)})")
    for d in chosen:
        for code in (d.src, d.tgt):
            check_lang(code, langs, data)
        if d.src == d.tgt:
            raise OptionError(f"direction {d.name}: source and target are one language")
        if raw is not None and not _raw_present(Path(raw), split, d):
            raise OptionError(f"direction {d.name}: {raw} has no {split}.{d.name}.{d.src} and "
                              f".{d.tgt} (nor the reverse pair's files)")
        if raw is None and not _binarized(data, split, d):
            raise OptionError(f"direction {d.name}: {data} has no {split} set for it "
                              f"({split}.{d.name}.{d.src}.bin, nor the reverse pair's)")
    if len(set(chosen)) != len(chosen):
        raise OptionError("a direction is given twice")
    return TestSet(data, split, tuple(chosen), langs, lang_pairs,
                   Path(raw) if raw is not None else None)
