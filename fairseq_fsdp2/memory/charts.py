"""PNG charts of memory: a run's ``memory.jsonl`` (per-rank peak over updates) and the
benchmark's side-by-side peaks. matplotlib is imported only here, when a chart is drawn."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional, Sequence

from ..errors import FSDP2Error


def read_memory_log(path) -> list[dict]:
    """The records of a ``memory.jsonl`` (one per log interval), in file order."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            rec["num_updates"], rec["ranks"]  # noqa: B018  (the fields the chart needs)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a memory.jsonl record ({e})") from None
        records.append(rec)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def per_rank_series(records: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    """rank -> (updates, peak GiB) over the log."""
    series: dict[int, tuple[list[int], list[float]]] = {}
    for rec in records:
        for r in rec["ranks"]:
            xs, ys = series.setdefault(int(r["rank"]), ([], []))
            xs.append(int(rec["num_updates"]))
            ys.append(float(r["peak_gb"]))
    return dict(sorted(series.items()))


def _pyplot():
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - the pinned requirements install it
        raise FSDP2Error("drawing a chart needs matplotlib (pip install -r requirements.txt)") \
            from None
    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq logs at DEBUG
    import matplotlib.pyplot as plt
    return plt


def plot_memory_log(records: list[dict], out, *, title: Optional[str] = None,
                    predicted_gb: Optional[float] = None) -> Path:
    """Per-rank peak memory over updates, one line per rank; optionally the estimator's
    prediction as a dashed line."""
    plt = _pyplot()
    series = per_rank_series(records)
    device = records[0].get("device", "?")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for rank, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=f"rank {rank}")
    if predicted_gb is not None:
        ax.axhline(predicted_gb, color="black", linestyle="--", linewidth=1,
                   label=f"predicted {predicted_gb:.2f} GiB")
    what = "peak resident memory (VmHWM)" if device == "cpu" else "allocator peak"
    ax.set_xlabel("update")
    ax.set_ylabel(f"GiB per rank ({what})")
    ax.set_title(title or f"per-rank peak memory per log interval ({len(series)} rank(s), "
                          f"{device})")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8, ncol=max(1, len(series) // 8))
    return _save(plt, fig, out)


def plot_benchmark(rows: Sequence[dict], out, *, title: str) -> Path:
    """Grouped bars: measured per-rank peak of each config at each world size, the
    estimator's prediction as a tick on each bar. rows: dicts with config, world_size,
    peak_gb, predicted_gb."""
    plt = _pyplot()
    configs = list(dict.fromkeys(r["config"] for r in rows))
    sizes = sorted({r["world_size"] for r in rows})
    by = {(r["config"], r["world_size"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    width = 0.8 / max(len(configs), 1)
    for i, cfg in enumerate(configs):
        xs, ys, preds = [], [], []
        for j, w in enumerate(sizes):
            r = by.get((cfg, w))
            if r is None:
                continue
            xs.append(j + (i - (len(configs) - 1) / 2) * width)
            ys.append(r["peak_gb"])
            preds.append(r.get("predicted_gb"))
        bars = ax.bar(xs, ys, width=width * 0.95, label=cfg)
        for x, p in zip(xs, preds):
            if p is not None:
                ax.plot([x - width * 0.45, x + width * 0.45], [p, p], color="black",
                        linewidth=1.5)
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"{w} rank{'s' if w > 1 else ''}" for w in sizes])
    ax.set_ylabel("peak memory per rank (GiB)")
    ax.set_title(title, fontsize=10)
    ax.plot([], [], color="black", linewidth=1.5, label="estimator's prediction")
    top = max((r["peak_gb"] for r in rows), default=1.0)
    ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(plt, fig, out)


def _save(plt, fig, out) -> Path:
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
