"""NLLB's metrics, computed by sacreBLEU itself, each with its signature.

- chrF++: ``CHRF(word_order=2)`` (NLLB: ``sacrebleu -m chrf --chrf-word-order 2``);
- spBLEU: BLEU on SentencePiece pieces of the FLORES-200 model (sacreBLEU's
  ``tokenize="flores200"``; NLLB: ``sacrebleu -tok spm``);
- BLEU: sacreBLEU's default (13a tokenization).

Offline spBLEU: sacreBLEU's flores200 tokenizer downloads its model on first use to
``$SACREBLEU/models/flores200sacrebleuspm`` (default ``~/.sacrebleu``). Here the model is a given
file (``--spbleu-model``), or sacreBLEU's downloaded copy when one is there; sacreBLEU's own
tokenizer class tokenizes with it (only the loading is ours). The signature says
``tok:flores200`` only when the file is byte for byte sacreBLEU's flores200 model; another file
(a data set's own SentencePiece model, say) is named ``tok:spm-<name>-<sha256 prefix>``, so a
table never claims FLORES-200 spBLEU for another tokenization. Without any model, spBLEU is
left out (None) and the report says why.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional, Sequence

METRICS = ("chrf++", "spbleu", "bleu")
LABELS = {"chrf++": "chrF++", "spbleu": "spBLEU", "bleu": "BLEU"}


def sacrebleu_flores200_file() -> Path:
    """Where sacreBLEU keeps (and looks for) its flores200 SentencePiece model."""
    from sacrebleu.tokenizers.tokenizer_spm import SPM_MODELS
    from sacrebleu.utils import SACREBLEU_DIR
    return Path(SACREBLEU_DIR) / "models" / os.path.basename(SPM_MODELS["flores200"]["url"])


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def spbleu_model(given: Optional[str]) -> tuple[Optional[Path], Optional[str]]:
    """The SentencePiece model spBLEU tokenizes with and the signature's name for it, or
    (None, None): none given and sacreBLEU has not downloaded its flores200 model."""
    cached = sacrebleu_flores200_file()
    if given is None:
        return (cached, "flores200") if cached.is_file() else (None, None)
    path = Path(given)
    digest = sha256(path)
    if cached.is_file() and sha256(cached) == digest:
        return path, "flores200"
    return path, f"spm-{path.stem}-{digest[:12]}"


def _spm_tokenizer(model: Path, name: str):
    """sacreBLEU's own SentencePiece tokenizer, its model loaded from ``model`` instead of
    sacreBLEU's download directory (its __init__ only picks the path and loads)."""
    import sentencepiece
    from sacrebleu.tokenizers.tokenizer_spm import TokenizerSPM
    tokenizer = TokenizerSPM.__new__(TokenizerSPM)
    tokenizer.name = name
    tokenizer.sp = sentencepiece.SentencePieceProcessor()
    tokenizer.sp.Load(str(model))
    return tokenizer


class Scorer:
    """The three metrics; ``spbleu`` is None without a SentencePiece model."""

    def __init__(self, spm_model: Optional[Path] = None, spm_name: Optional[str] = None):
        from sacrebleu.metrics import BLEU, CHRF
        self.metrics = {"chrf++": CHRF(word_order=2), "bleu": BLEU()}
        if spm_model is not None:
            spbleu = BLEU(tokenize="none")
            spbleu.tokenizer = _spm_tokenizer(spm_model, spm_name)
            spbleu.tokenizer_signature = spbleu.tokenizer.signature()
            self.metrics["spbleu"] = spbleu

    def signatures(self) -> dict[str, Optional[str]]:
        """Each metric's sacreBLEU signature (known once it has scored: it names the number of
        references); None for a metric left out."""
        for metric in self.metrics.values():
            if not hasattr(metric, "num_refs"):  # nothing scored here (another rank did):
                metric.corpus_score(["x"], [["x"]])  # one reference each, as the scores had
        return {k: (str(self.metrics[k].get_signature()) if k in self.metrics else None)
                for k in METRICS}

    def score(self, hypotheses: Sequence[str], references: Sequence[str]) -> dict:
        """Each metric's corpus score (None for a metric without its model)."""
        if len(hypotheses) != len(references):
            raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
        return {k: (self.metrics[k].corpus_score(list(hypotheses), [list(references)]).score
                    if k in self.metrics else None) for k in METRICS}
