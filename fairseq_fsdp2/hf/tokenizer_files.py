"""Hugging Face NLLB tokenizer files, copied and grown for a model whose vocabulary has new
language codes and pieces (``prepare_data.sh --hf-model DIR --add-langs ... --add-pieces ...``),
and put beside an export (``consolidate --format hf``).

The files (as the hub has them): ``sentencepiece.bpe.model``, ``tokenizer.json`` (the fast
tokenizer: a BPE model whose vocabulary holds every piece with its id, the merges that build
them, and the language codes and other specials as "added tokens" with their ids),
``tokenizer_config.json`` and, from older transformers versions, ``special_tokens_map.json``
(the lists of special tokens: the language codes among them). Growing them:
- a new language code becomes an added special token at its dictionary row, and joins the
  lists of special tokens (``extra_special_tokens``, or ``additional_special_tokens``) that
  ``NllbTokenizer`` takes its languages from;
- a new piece enters the BPE vocabulary at its dictionary row, with a merge for each split of
  it into two pieces of the vocabulary, ranked after every merge of the model (the order of
  the new pieces' SentencePiece scores, as Hugging Face's own conversion ranks merges), so the
  fast tokenizer splits text as SentencePiece does with the grown model;
- ``sentencepiece.bpe.model`` is the grown SentencePiece model.
Only JSON is edited: neither ``tokenizers`` nor ``transformers`` is needed.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional, Sequence

from .vocab import SPM_FILE

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TOKENIZER_FILES = (SPM_FILE, TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
#: where data preparation keeps the model's tokenizer files (DEST/hf_tokenizer)
DATA_SUBDIR = "hf_tokenizer"
_SPECIAL_LISTS = ("extra_special_tokens", "additional_special_tokens")


class TokenizerError(ValueError):
    """Tokenizer files that cannot be grown as asked (one line)."""


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _write(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def _grow_tokenizer_json(content: dict, rows: Sequence[str], langs: Sequence[str],
                         pieces: Sequence[str], where: Path) -> dict:
    model = content["model"]
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise TokenizerError(f"{where}: cannot grow a {model.get('type')} tokenizer model "
                             f"(NLLB's is BPE)")
    vocab = model["vocab"]
    added = {t["content"]: t["id"] for t in content["added_tokens"]}
    for row, token in enumerate(rows):
        have = vocab.get(token, added.get(token))
        if have is not None and have != row:
            raise TokenizerError(f"{where}: {token!r} has id {have}, but row {row} of the "
                                 f"dictionary")
    if pieces:
        model["merges"] = _grown_merges(vocab, model["merges"], pieces)
    for code in langs:
        content["added_tokens"].append({
            "id": rows.index(code), "content": code, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True})
    # Every row in the BPE vocabulary, the added tokens and rows without a token (as
    # madeupwordNNNN, which no merge makes) included: ids 0..rows-1 without a gap. A loader that
    # rebuilds the tokenizer from vocabulary and merges and adds the special tokens after it
    # (transformers 5's NllbTokenizer) numbers them in turn after the vocabulary, so only a
    # vocabulary without gaps gives each its row.
    for row, token in enumerate(rows):
        vocab.setdefault(token, row)
    return content


def _grown_merges(vocab: dict, merges: list, new: Sequence[str]) -> list:
    """The BPE merges with the new pieces: a merge for every split of a piece into two pieces
    of the grown vocabulary that one of the new pieces takes part in. A merge that makes a new
    piece ranks after all the model's, in the new pieces' order; one that makes a piece of the
    model out of a new piece ranks with that piece's own merges (SentencePiece's BPE merges
    any two adjacent pieces whose concatenation it has, at that piece's score)."""
    grown, fresh = set(vocab) | set(new), set(new)
    as_text = bool(merges) and isinstance(merges[0], str)

    def splits(piece: str, needs_new: bool) -> list:
        found = []
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in grown and right in grown and \
                    (not needs_new or left in fresh or right in fresh):
                found.append(f"{left} {right}" if as_text else [left, right])
        return found

    extra = {piece: splits(piece, True) for piece in vocab if len(piece) > 1}
    last = {}
    for i, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if as_text else merge
        last[left + right] = i
    result = []
    for i, merge in enumerate(merges):
        result.append(merge)
        left, right = merge.split(" ", 1) if as_text else merge
        if last[left + right] == i:
            result += extra.pop(left + right, [])
    for found in extra.values():  # the model's pieces that no merge of it made
        result += found
    for piece in new:
        result += splits(piece, False)
    return result


def _add_special_codes(content: dict, codes: Sequence[str]) -> dict:
    for key in _SPECIAL_LISTS:
        if isinstance(content.get(key), list):
            content[key] = content[key] + [c for c in codes if c not in content[key]]
            break
    return content


def write_tokenizer(base: Path, out: Path, spm_model: Path, rows: Sequence[str] = (),
                    langs: Sequence[str] = (), pieces: Sequence[str] = ()) -> list[str]:
    """Write the tokenizer files of the HF model directory ``base`` into ``out`` (created),
    with ``spm_model`` as its SentencePiece model. Growing (``rows`` given): ``rows`` is the HF
    token of every dictionary row (a language as ``xxx_Latn``), among them the new language
    codes ``langs`` and the new ``pieces``. Returns the file names written."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spm_model, out / SPM_FILE)
    written = [SPM_FILE]
    for name in TOKENIZER_FILES[1:]:
        source = base / name
        if not source.is_file():
            continue
        if not rows:
            shutil.copyfile(source, out / name)
        else:
            content = _read(source)
            if name == TOKENIZER_JSON:
                content = _grow_tokenizer_json(content, rows, langs, pieces, source)
            decoder = content.get("added_tokens_decoder")
            if name == TOKENIZER_CONFIG and isinstance(decoder, dict):
                for code in langs:
                    decoder[str(rows.index(code))] = {
                        "content": code, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
            if name != TOKENIZER_JSON:
                content = _add_special_codes(content, langs)
            _write(out / name, content)
        written.append(name)
    return written


def largest_id(directory: Path) -> Optional[int]:
    """The largest token id of the tokenizer files in ``directory`` (None without
    tokenizer.json)."""
    path = directory / TOKENIZER_JSON
    if not path.is_file():
        return None
    content = _read(path)
    ids = [t["id"] for t in content["added_tokens"]]
    vocab = content["model"].get("vocab")
    ids += list(vocab.values()) if isinstance(vocab, dict) else [len(vocab or []) - 1]
    return max(ids)


def copy_tokenizer(source: Path, out: Path) -> list[str]:
    """Copy the tokenizer files present in ``source`` into ``out``; returns their names."""
    names = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in names:
        shutil.copyfile(source / name, out / name)
    return names
