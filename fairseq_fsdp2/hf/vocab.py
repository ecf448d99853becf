"""Which token a Hugging Face NLLB model expects on each embedding row, in fairseq's terms.

Hugging Face's ``NllbTokenizer`` numbers its vocabulary the way fairseq's NLLB dictionary does:
``<s> <pad> </s> <unk>`` are 0-3, SentencePiece piece ``i`` (``i >= 3``; the model's own ids
0-2 are its specials) is row ``i + 1`` (HF's "fairseq offset"), the language codes follow the
pieces in the order of ``FAIRSEQ_LANGUAGE_CODES`` (= ``models.nllb_languages.NLLB200_LANGS``), then
``<mask>``; the embedding may have a few more rows than the tokenizer (NLLB-200: 256,206 rows,
256,204 tokens: fairseq's data-source tags). fairseq writes a language as ``__eng_Latn__``.

A fairseq dictionary whose every entry sits on that row makes the weights usable as they are:
``scripts/prepare_data.sh RAW DEST --hf-model DIR`` writes one (``dictionary_lines``), and
``--finetune-from-model DIR`` checks it (``dictionary_problem``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from ..models.nllb_languages import LANG_CODE, NLLB200_LANGS, lang_of_token

SPM_FILE = "sentencepiece.bpe.model"
CONFIG_FILE = "config.json"
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's and HF's rows 0-3
FILLER = "madeupword{:04d}"  # fairseq's own name for rows that hold no token


def model_dir(path: Path) -> Path:
    """The directory holding a model's config and tokenizer files (the model's own directory,
    or the one a bare .safetensors file lies in)."""
    path = Path(path)
    return path if path.is_dir() else path.parent


def read_config(path: Path) -> Optional[dict]:
    config = model_dir(path) / CONFIG_FILE
    return json.loads(config.read_text()) if config.is_file() else None


def tokenizer_added_ids(directory: Path) -> Optional[dict[str, int]]:
    """token -> id of the tokenizer's added tokens (specials, language codes, <mask>), from
    tokenizer.json or tokenizer_config.json; None if the directory has neither."""
    fast, slow = directory / "tokenizer.json", directory / "tokenizer_config.json"
    if fast.is_file():
        return {t["content"]: int(t["id"]) for t in json.loads(fast.read_text())["added_tokens"]}
    if slow.is_file():
        decoder = json.loads(slow.read_text()).get("added_tokens_decoder")
        if decoder:
            return {t["content"]: int(i) for i, t in decoder.items()}
    return None


def fairseq_token(hf_token: str) -> str:
    return f"__{hf_token}__" if LANG_CODE.match(hf_token) else hf_token


def expected_rows(directory: Path, rows: int) -> list[Optional[str]]:
    """The fairseq token each of ``rows`` embedding rows stands for (None: no token), from the
    model directory's SentencePiece model and tokenizer files."""
    import sentencepiece as spm


    sp = spm.SentencePieceProcessor(model_file=str(directory / SPM_FILE))
    pieces = sp.get_piece_size()
    added = tokenizer_added_ids(directory)
    if added is None:  # NllbTokenizer's own rule
        added = {lang: pieces + 1 + k for k, lang in enumerate(NLLB200_LANGS)}
        added["<mask>"] = pieces + 1 + len(NLLB200_LANGS)
    expected: list[Optional[str]] = [None] * rows
    expected[:4] = SPECIALS
    for i in range(3, min(pieces, rows - 1)):
        expected[i + 1] = sp.id_to_piece(i)
    for token, i in added.items():
        if token not in SPECIALS and 0 <= i < rows:
            expected[i] = fairseq_token(token)
    return expected


def dictionary_for(directory: Path) -> tuple[Path, list[str], list[str]]:
    """For an HF model directory: its SentencePiece model, the dict.txt lines that put every
    token on its row, and its languages in row order. ValueError if it lacks what is needed."""
    config, model = directory / CONFIG_FILE, directory / SPM_FILE
    for path in (config, model):
        if not path.is_file():
            raise ValueError(f"{path} not found (a Hugging Face NLLB model directory has "
                             f"{CONFIG_FILE} and {SPM_FILE})")
    rows = read_config(directory).get("vocab_size")
    if not isinstance(rows, int):
        raise ValueError(f"{config} has no vocab_size")
    import sentencepiece as spm
    needed = spm.SentencePieceProcessor(model_file=str(model)).get_piece_size() + 1
    if rows < needed:
        raise ValueError(f"the embedding has {rows} rows, fewer than its SentencePiece model "
                         f"needs ({needed})")
    expected = expected_rows(directory, rows)
    return model, dictionary_lines(expected), languages(expected)


def dictionary_lines(expected: Sequence[Optional[str]]) -> list[str]:
    """dict.txt lines that put every token on its row (rows 0-3 are fairseq's own specials)."""
    return [f"{token} 1" if token is not None else f"{FILLER.format(i)} 0"
            for i, token in enumerate(expected) if i >= len(SPECIALS)]


def languages(expected: Sequence[Optional[str]]) -> list[str]:
    """The language codes of the rows, in row order."""
    return [code for t in expected if t and (code := lang_of_token(t))]


def dictionary_problem(source: Path, symbols: Sequence[str], rows: int) -> Optional[str]:
    """Why a fairseq dictionary does not line up with an HF model's rows (its first ``rows``
    entries: the model's own), or None."""
    fix = f"build the data with scripts/prepare_data.sh RAW DEST --hf-model {model_dir(source)}"
    if len(symbols) < rows:  # more entries: a grown vocabulary (checkpoint/grown_embedding.py)
        return (f"the dictionary has {len(symbols)} entries and the model's embedding "
                f"{rows} rows: {fix}")
    directory = model_dir(source)
    if (directory / SPM_FILE).is_file():
        expected = expected_rows(directory, rows)
        for i, (have, want) in enumerate(zip(symbols, expected)):
            if want is not None and have != want:
                return (f"dictionary entry {i} is {have!r}, but row {i} of the model is "
                        f"{want!r} for its tokenizer: {fix}")
        return None
    # no tokenizer at hand: the languages must be NLLB's block, in NllbTokenizer's order

    index = {s: i for i, s in enumerate(symbols)}
    first = index.get(fairseq_token(NLLB200_LANGS[0]))
    for k, lang in enumerate(NLLB200_LANGS):
        token = fairseq_token(lang)
        if token in index and (first is None or index[token] != first + k):
            return (f"dictionary entry {index[token]} is {token}, but the model's tokenizer "
                    f"puts the NLLB languages in one block in NLLB's order: {fix}")
    return None
