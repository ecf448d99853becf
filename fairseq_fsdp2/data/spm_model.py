"""SentencePiece models: training one on text, and adding pieces to a copy of one.

Pieces are added in the model file itself (its ``ModelProto``: piece and score), so that every
reader of the file uses them: ``spm_encode``, ``sentencepiece.SentencePieceProcessor`` here, and
Hugging Face's tokenizer converted from it. How a new piece's score is chosen depends on the
model type:
- unigram: the score given with the piece (e.g. from the SentencePiece model trained on the new
  text: its log-probability there), else the lowest score of the model's own pieces; the
  segmentation maximises the sum of scores, so a new piece covering what took several pieces
  before is preferred;
- BPE: below every score of the model, in the order given: SentencePiece's BPE merges two
  adjacent pieces into the highest-scoring piece that exists, so the model's own merges keep
  their order and the new ones come after them. A new piece is only ever produced if it splits
  into two pieces of the model (its own or new ones); one that does not is refused.
"""
from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Iterable, Optional, Sequence

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2

from .inputs import PrepareError

UNIGRAM, BPE = "unigram", "bpe"
_TYPES = {model_pb2.TrainerSpec.UNIGRAM: UNIGRAM, model_pb2.TrainerSpec.BPE: BPE,
          model_pb2.TrainerSpec.WORD: "word", model_pb2.TrainerSpec.CHAR: "char"}
NORMAL = model_pb2.ModelProto.SentencePiece.NORMAL


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


def read_model(path: Path) -> model_pb2.ModelProto:
    proto = model_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(path).read_bytes())
    except Exception as e:  # noqa: BLE001  (protobuf's DecodeError and OS errors alike)
        raise PrepareError(f"cannot read SentencePiece model {path}: {e}") from None
    if not proto.pieces:
        raise PrepareError(f"cannot read SentencePiece model {path}: it has no pieces")
    return proto


def model_type(proto: model_pb2.ModelProto) -> str:
    return _TYPES.get(proto.trainer_spec.model_type, str(proto.trainer_spec.model_type))


def normal_pieces(proto: model_pb2.ModelProto) -> list[tuple[str, float]]:
    """(piece, score) of the model's ordinary pieces (no control, unknown or byte pieces), in
    id order."""
    return [(p.piece, p.score) for p in proto.pieces if p.type == NORMAL]


def read_pieces_file(path: Path) -> list[tuple[str, Optional[float]]]:
    """Pieces, one a line: ``piece`` or ``piece score`` (a SentencePiece .vocab file works)."""
    found = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PrepareError(f"cannot read --add-pieces file {path}: {e}") from None
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        try:
            score = float(fields[1]) if len(fields) == 2 else None
        except ValueError:
            score = None
        if len(fields) > 2 or (len(fields) == 2 and score is None):
            raise PrepareError(f"{path}:{number}: expected a piece, or a piece and its score "
                               f"(spaces in a piece are written '\u2581')")
        found.append((fields[0], score))
    return found


def unreachable_bpe(pieces: Iterable[str], vocab: set[str]) -> Optional[str]:
    """The first of ``pieces`` that BPE cannot produce from ``vocab``: one that is longer than
    one character and has no split into two pieces it can produce."""
    known: dict[str, bool] = {}

    def producible(piece: str) -> bool:
        if piece not in known:
            known[piece] = False  # guards against cycles; pieces only shrink below
            known[piece] = len(piece) == 1 or any(
                piece[:k] in vocab and piece[k:] in vocab
                and producible(piece[:k]) and producible(piece[k:])
                for k in range(1, len(piece)))
        return known[piece]

    return next((p for p in pieces if not producible(p)), None)


def add_pieces(model: Path, pieces: Sequence[tuple[str, Optional[float]]], out: Path,
               where: str) -> list[str]:
    """Write a copy of ``model`` to ``out`` with the ``pieces`` it lacks appended (scores: see
    the module docstring); returns the pieces added, in their new id order. ``where`` names the
    pieces' origin in errors."""
    proto = read_model(model)
    kind = model_type(proto)
    if kind not in (UNIGRAM, BPE):
        raise PrepareError(f"cannot add pieces to {model}: a {kind} SentencePiece model "
                           f"(unigram and BPE models take new pieces)")
    have = {p.piece for p in proto.pieces}
    new: dict[str, Optional[float]] = {}
    for piece, score in pieces:
        if not piece or any(c.isspace() or not c.isprintable() for c in piece):
            raise PrepareError(f"{where}: {piece!r} is not a piece (no spaces or control "
                               f"characters; a space is written '\u2581')")
        if piece not in have and piece not in new:
            new[piece] = score
    if kind == BPE:
        missing = unreachable_bpe(new, have | set(new))
        if missing is not None:
            raise PrepareError(f"{where}: the BPE model could never produce the piece "
                               f"{missing!r}: no split of it into two pieces of the model; add "
                               f"the pieces it is made of too")
    lowest = min(score for _, score in normal_pieces(proto))
    for i, (piece, score) in enumerate(new.items()):
        if kind == BPE:
            score = lowest - 1.0 - i  # after every merge of the model, in the order given
        elif score is None:
            score = lowest
        proto.pieces.add(piece=piece, score=score, type=NORMAL)
    proto.trainer_spec.vocab_size = len(proto.pieces)
    out.write_bytes(proto.SerializeToString())
    try:
        loaded = spm.SentencePieceProcessor(model_file=str(out))
    except (OSError, RuntimeError) as e:
        raise PrepareError(f"the SentencePiece model with the new pieces does not load: "
                           f"{e}") from None
    assert loaded.get_piece_size() == len(proto.pieces)
    return list(new)
