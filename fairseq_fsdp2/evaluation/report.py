"""The evaluation's outputs: per-direction results, the baseline comparison (the forgetting
check: a direction whose chrF++ fell by more than ``max_drop`` points is marked), a markdown
table, the JSON file and the chart."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .scores import LABELS, METRICS

MODEL, BASELINE = "model", "baseline"


@dataclass
class Result:
    """One direction: each model's scores and hypothesis file."""

    direction: str
    scores: dict[str, dict] = field(default_factory=dict)  # model role -> metric -> score
    hypotheses: dict[str, str] = field(default_factory=dict)  # model role -> path
    sentences: int = 0

    def delta(self, metric: str) -> Optional[float]:
        a, b = (self.scores.get(r, {}).get(metric) for r in (MODEL, BASELINE))
        return None if a is None or b is None else a - b

    def dropped(self, max_drop: float) -> bool:
        """chrF++ fell by more than ``max_drop`` points against the baseline."""
        d = self.delta("chrf++")
        return d is not None and -d > max_drop


def _num(x: Optional[float], signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.2f}" if signed else f"{x:.2f}"


def table(results: list[Result], max_drop: float) -> str:
    """A markdown table: per direction each metric of the model, and with a baseline the
    baseline's and the difference, the directions that dropped marked."""
    compare = any(BASELINE in r.scores for r in results)
    head = ["direction"]
    for m in METRICS:
        head += [f"{LABELS[m]} base", LABELS[m], "Δ"] if compare else [LABELS[m]]
    if compare:
        head.append(f"dropped > {max_drop:g} chrF++")
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in results:
        cells = [r.direction]
        for m in METRICS:
            own = r.scores[MODEL].get(m)
            if compare:
                cells += [_num(r.scores.get(BASELINE, {}).get(m)), _num(own),
                          _num(r.delta(m), signed=True)]
            else:
                cells.append(_num(own))
        if compare:
            cells.append("**DROPPED**" if r.dropped(max_drop) else "")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_json(path: Path, results: list[Result], meta: dict, max_drop: float) -> None:
    """The JSON report: settings, models, signatures (in ``meta``), and per direction each
    model's scores and hypotheses' path, the differences and whether it dropped."""
    compare = any(BASELINE in r.scores for r in results)
    out = dict(meta)
    out["max_drop"] = max_drop if compare else None
    out["directions"] = {
        r.direction: {"sentences": r.sentences, "scores": r.scores, "hypotheses": r.hypotheses,
                      **({"delta": {m: r.delta(m) for m in METRICS},
                          "dropped": r.dropped(max_drop)} if compare else {})}
        for r in results}
    out["dropped"] = [r.direction for r in results if compare and r.dropped(max_drop)]
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def plot(path: Path, results: list[Result], labels: dict[str, str]) -> None:
    """Per-direction bars of chrF++ (and spBLEU where computed), the baseline beside the
    model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metrics = [m for m in ("chrf++", "spbleu")
               if any(r.scores[MODEL].get(m) is not None for r in results)]
    roles = [role for role in (BASELINE, MODEL) if any(role in r.scores for r in results)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(max(5, 1.6 * len(results)) *
                                                       len(metrics), 4), squeeze=False)
    width = 0.8 / len(roles)
    for ax, metric in zip(axes[0], metrics):
        for k, role in enumerate(roles):
            xs = [i + (k - (len(roles) - 1) / 2) * width for i in range(len(results))]
            ax.bar(xs, [r.scores.get(role, {}).get(metric) or 0 for r in results], width,
                   label=labels[role])
        ax.set_xticks(range(len(results)), [r.direction for r in results], rotation=20,
                      ha="right")
        ax.set_ylabel(LABELS[metric])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
