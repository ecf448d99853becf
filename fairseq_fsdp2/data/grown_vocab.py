"""Growing a pretrained model's vocabulary for data preparation: new language codes
(``--add-langs xxx_Latn,yyy_Cyrl``) and new SentencePiece pieces (``--add-pieces FILE``,
``--train-pieces N``).

The dictionary written keeps the model's rows exactly where they are (its first rows are the
model's: from ``--hf-model DIR``, or ``--dict`` [+ the NLLB-200 languages with ``--dict-langs
nllb200``] up to ``--model-rows``), then the new ``__xxx_Latn__`` tokens, then the new pieces
(and pieces of the model's SentencePiece model that the new training text uses and a
dictionary built from other text lacked), then fairseq's padding (``madeupwordNNNN``, to a
multiple of ``--padding-factor``, as fairseq-preprocess pads a dictionary it builds). The new
pieces go into a copy of the model's
SentencePiece model (spm_model.py), which encodes the data and becomes DEST/spm.model. With
``--hf-model`` the model's tokenizer files are grown alike into DEST/hf_tokenizer
(hf/tokenizer_files.py), for the export back to Hugging Face.

DEST/vocab_growth.json records what was added where (growth_record.py); fine-tuning reads it to
check that the checkpoint has the rows the dictionary was grown from
(checkpoint/grown_embedding.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..hf.tokenizer_files import DATA_SUBDIR, TokenizerError, write_tokenizer
from ..hf.vocab import FILLER, dictionary_for
from ..models.nllb_languages import NLLB200_LANGS, lang_of_token
from .dictionary import FAIRSEQ_SPECIALS, lang_token, padding_lines, read_dict_lines, \
    read_dict_tokens
from .growth_record import write_record
from .inputs import PrepareError, check_code
from .spm_model import add_pieces, model_type, normal_pieces, read_model, read_pieces_file, \
    train_spm


@dataclass
class BaseVocabulary:
    """The pretrained model's vocabulary: its dictionary lines (after fairseq's 4 specials), one
    per embedding row, its languages in row order, its SentencePiece model."""
    lines: list[str]
    langs: list[str]
    spm_model: Path
    source: str
    hf_dir: Optional[Path] = None

    @property
    def rows(self) -> int:
        return len(self.lines) + len(FAIRSEQ_SPECIALS)


@dataclass
class Growth:
    """What is added after the model's rows: language codes, pieces, the model's pieces its
    dictionary lacked, padding."""
    base: BaseVocabulary
    langs: list[str]
    pieces: list[str] = field(default_factory=list)
    #: pieces of the model's own SentencePiece model that its dictionary did not list
    listed: list[str] = field(default_factory=list)
    padding: list[str] = field(default_factory=list)

    def dictionary_lines(self) -> list[str]:
        return self.base.lines + [f"{lang_token(c)} 1" for c in self.langs] + \
            [f"{p} 1" for p in self.pieces + self.listed] + self.padding

    def rows(self) -> dict[str, list[tuple[str, int]]]:
        """The new entries by kind, each with its row."""
        row, found = self.base.rows, {}
        for kind, tokens in (("langs", self.langs), ("pieces", self.pieces),
                             ("listed", self.listed),
                             ("padding", [line.split(" ")[0] for line in self.padding])):
            found[kind] = [(t, row + i) for i, t in enumerate(tokens)]
            row += len(tokens)
        return found

    def record(self) -> dict:
        rows = self.rows()
        return {"model": self.base.source, "model_rows": self.base.rows,
                "rows": self.base.rows + sum(len(v) for v in rows.values()),
                "langs": {lang_token(c): r for c, r in rows["langs"]},
                "pieces": dict(rows["pieces"]), "listed": dict(rows["listed"]),
                "padding": dict(rows["padding"])}


def parse_add_langs(spec: Optional[str]) -> list[str]:
    codes = [c.strip() for c in (spec or "").split(",") if c.strip()]
    for code in codes:
        check_code(code, "--add-langs")
    if len(set(codes)) != len(codes):
        raise PrepareError(f"--add-langs names a language twice: {spec}")
    return codes


def base_vocabulary(hf_model: Optional[Path], spm_model: Optional[Path],
                    dictionary: Optional[Path], dict_langs: str,
                    model_rows: Optional[int]) -> BaseVocabulary:
    """The rows of the model being grown, from its HF directory or its fairseq files."""
    if hf_model is not None:
        try:
            model, lines, langs = dictionary_for(Path(hf_model))
        except ValueError as e:
            raise PrepareError(f"--hf-model: {e}") from None
        return BaseVocabulary(lines, langs, model, f"--hf-model {hf_model}", Path(hf_model))
    if spm_model is None or dictionary is None:
        raise PrepareError("--add-langs, --add-pieces and --train-pieces grow a pretrained "
                           "model's vocabulary: give the model's --hf-model DIR, or its "
                           "--spm-model and --dict")
    lines = read_dict_lines(dictionary)
    tokens = read_dict_tokens(dictionary)
    if dict_langs == "nllb200":
        present = set(tokens)
        added = [lang_token(c) for c in NLLB200_LANGS if lang_token(c) not in present]
        lines += [f"{t} 1" for t in added]
        tokens += added
    entries = len(lines) + len(FAIRSEQ_SPECIALS)
    if model_rows is not None:
        if model_rows < entries:
            raise PrepareError(f"--model-rows {model_rows} is fewer than the dictionary's "
                               f"{entries} entries")
        lines += [f"{FILLER.format(row)} 0" for row in range(entries, model_rows)]
    langs = [code for t in tokens if (code := lang_of_token(t))]
    return BaseVocabulary(lines, langs, Path(spm_model), f"--dict {dictionary}")


def check_new_langs(base: BaseVocabulary, langs: Sequence[str]) -> None:
    known = {line.split(" ")[0] for line in base.lines}
    for code in langs:
        if lang_token(code) in known:
            raise PrepareError(f"--add-langs {code}: the model has that language already")


def pieces_to_add(base: BaseVocabulary, add_pieces_file: Optional[Path], train_pieces: int,
                  new_text: Sequence[str], work: Path, seed: int
                  ) -> tuple[list[tuple[str, Optional[float]]], str]:
    """The candidate pieces (with scores where known) and where they come from: the file's
    (read_pieces_file), then those of a SentencePiece model of ``train_pieces`` pieces, of the
    model's type, trained on ``new_text``."""
    found, origin = [], []
    if add_pieces_file is not None:
        found += read_pieces_file(add_pieces_file)  # read before any work too: its errors
        origin.append(f"--add-pieces {add_pieces_file}")
    if train_pieces:
        kind = model_type(read_model(base.spm_model))
        trained = train_spm(list(new_text), work / "new_pieces", train_pieces, kind,
                            1_000_000, seed)
        found += normal_pieces(read_model(trained))
        origin.append(f"the {kind} model of {train_pieces} pieces trained on the new text")
    return found, " and ".join(origin)


def grow(base: BaseVocabulary, langs: Sequence[str],
         pieces: Sequence[tuple[str, Optional[float]]], pieces_origin: str,
         work: Path) -> tuple[Path, Growth]:
    """The grown SentencePiece model (in ``work``) and what is added to the dictionary (to be
    ``complete``d once the text is encoded)."""
    check_new_langs(base, langs)
    known = {line.split(" ")[0] for line in base.lines}
    model = base.spm_model
    new_pieces: list[str] = []
    if pieces:
        model = work / "spm_grown.model"
        new_pieces = add_pieces(base.spm_model, pieces, model, pieces_origin)
        clash = next((p for p in new_pieces if p in known), None)
        if clash is not None:
            raise PrepareError(f"{pieces_origin}: {clash!r} is a dictionary entry of the "
                               f"model but not a piece of its SentencePiece model")
    return model, Growth(base, list(langs), new_pieces)


def complete(growth: Growth, encoded_train: Sequence[Path], padding_factor: int) -> None:
    """After encoding: add the pieces the training text uses that the dictionary lacks (a
    dictionary built from other text need not list every piece of its SentencePiece model),
    most frequent first, then fairseq's padding."""
    known = {line.split(" ")[0] for line in growth.base.lines} | set(growth.pieces) | \
        set(FAIRSEQ_SPECIALS)
    counts = Counter()
    for path in encoded_train:
        with open(path, encoding="utf-8") as f:
            for line in f:
                counts.update(t for t in line.split() if t not in known)
    growth.listed = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    entries = growth.base.rows + len(growth.langs) + len(growth.pieces) + len(growth.listed)
    growth.padding = padding_lines(known | set(growth.listed), entries, padding_factor)


def write_outputs(growth: Growth, model: Path, dest: Path) -> None:
    """DEST/vocab_growth.json and, for a Hugging Face model, DEST/hf_tokenizer."""
    write_record(dest, growth.record())
    if growth.base.hf_dir is not None:
        tokens = [*FAIRSEQ_SPECIALS, *(line.split(" ")[0] for line in growth.dictionary_lines())]
        rows = [lang_of_token(t) or t for t in tokens]  # HF's names: xxx_Latn for __xxx_Latn__
        try:
            write_tokenizer(growth.base.hf_dir, dest / DATA_SUBDIR, model, rows,
                            langs=growth.langs, pieces=growth.pieces)
        except TokenizerError as e:
            raise PrepareError(str(e)) from None


def copy_hf_tokenizer(hf_dir: Path, model: Path, dest: Path) -> None:
    """The model's tokenizer files, unchanged, into DEST/hf_tokenizer (for the export)."""
    write_tokenizer(hf_dir, dest / DATA_SUBDIR, model)
