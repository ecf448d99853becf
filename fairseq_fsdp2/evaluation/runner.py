"""One evaluation: every direction translated by the model (and the baseline), written, scored."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

from .generation import FairseqTranslator, Generation, generate_argv, progress_bar
from .inputs import TestSet
from .models import ModelSource
from .report import Result
from .scores import Scorer


def translator(model: ModelSource, test: TestSet, gen: Generation):
    if model.kind == "ctranslate2":
        from .ctranslate2_export import CT2Translator
        return CT2Translator(model, test, gen)
    return FairseqTranslator(model, test, gen)


def _write_lines(path: Path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def evaluate(test: TestSet, models: dict[str, ModelSource], gen: Generation, scorer: Scorer,
             out: Path, show_progress: bool = True, log=print,
             directions: Optional[list] = None) -> list[Result]:
    """``models``: role ("model", "baseline") -> the checked model; ``directions``: those to
    translate here (default: all; under torchrun this rank's, ranks.py). Hypotheses go to
    ``out/ROLE/SPLIT.SRC-TGT.TGT``, references to ``out/references/``."""
    directions = list(test.directions if directions is None else directions)
    if not directions:
        return []
    translators = {role: translator(m, test, gen) for role, m in models.items()}
    results = []
    for d in directions:
        result = Result(d.name)
        for role, t in translators.items():
            bar = progress_bar(f"{role} {d.name}") if show_progress else (
                lambda it, **kw: it)
            tr = t.translate(d, bar)
            name = f"{test.split}.{d.name}.{d.tgt}"
            result.hypotheses[role] = _write_lines(out / role / name, tr.hypotheses)
            _write_lines(out / "references" / name, tr.references)
            result.scores[role] = scorer.score(tr.hypotheses, tr.references)
            result.sentences = len(tr.hypotheses)
            log(f"{role} {d.name}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in result.scores[role].items() if v is not None))
        results.append(result)
    return results


def meta(test: TestSet, models: dict[str, ModelSource], gen: Generation, scorer: Scorer,
         settings_source: str, spm: Optional[tuple]) -> dict:
    """What the JSON report says besides the scores."""
    return {
        "data": str(test.data), "raw": str(test.raw) if test.raw else None,
        "split": test.split, "references": "raw text files" if test.raw else
        "the binarized split, decoded (SentencePiece-normalized), as fairseq-generate's",
        "models": {role: {"path": str(m.path), "kind": m.kind, "label": m.label,
                          "encoder_langtok": m.encoder_langtok,
                          "decoder_langtok": m.decoder_langtok,
                          # the stock command that writes the same translations (first
                          # direction; the others differ in --source-lang/--target-lang)
                          "fairseq_generate": "fairseq-generate " + shlex.join(generate_argv(
                              test, test.directions[0], m, gen.resolved()))
                          if m.kind == "fairseq" else None}
                   for role, m in models.items()},
        "generation": gen.resolved().as_dict(), "generation_defaults_from": settings_source,
        "signatures": scorer.signatures(),
        "spbleu_model": None if spm is None or spm[0] is None else
        {"path": str(spm[0]), "name": spm[1]},
    }
