"""Per-rank memory breakdown of one chosen update (``--fsdp2-memory-breakdown N``).

What: for update N only, every rank records each tensor storage it allocates or holds, by
category, and keeps (1) the categories at the moment of the rank's overall peak, (2) each
category's own maximum over the update, and (3) the bytes attributed to each module (allocated
while it was the innermost running module, forward or backward, and still alive). Rank 0
gathers every rank's record, logs one table (a column per rank) and writes
``<save-dir>/memory_breakdown.json``. The other updates pay one integer comparison.

How storages are classified, and why we use our own tracker: tracker.py (imported for the
chosen update only).

Only tensors allocated or tagged inside the tracked update count: the batch and anything the
process holds outside the model/optimizer (fairseq's data, Python, libraries) do not, so the
tracked peak is below the process's resident peak (``memory.jsonl``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

FILE_NAME = "memory_breakdown.json"


# -- the option: record update N, gather, report ------------------------------------------------
@contextlib.contextmanager
def record_update(trainer) -> Iterator[None]:
    """Around a fairseq ``train_step``: record it if it makes update ``--fsdp2-memory-breakdown``.

    Every rank records; when the step completes, rank 0 logs the table and writes the JSON. A
    step that raises (e.g. an fp16 overflow, which does not count as an update) reports
    nothing, and the next attempt at the same update is recorded instead.
    """
    chosen = getattr(trainer.cfg.distributed_training, "fsdp2_memory_breakdown", 0)
    update = trainer.get_num_updates() + 1
    if not chosen or update != chosen:
        yield
        return
    from .tracker import BreakdownTracker, torch_optimizer  # heavy: the chosen update only

    model, optimizer = trainer.model, trainer.optimizer  # built now, not inside the record
    tracker = BreakdownTracker(model, trainer.criterion, torch_optimizer(optimizer),
                               trainer.device)
    with tracker:
        yield
    save_dir = None if trainer.cfg.checkpoint.no_save else trainer.cfg.checkpoint.save_dir
    report(tracker.result(), update, trainer.device, save_dir)


def gather(record: dict) -> list[dict]:
    """Every rank's record, in rank order (on every rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [record]
    records: list[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records  # type: ignore[return-value]


def report(record: dict, update: int, device: torch.device,
           save_dir: Optional[str]) -> Optional[dict]:
    """Gather to rank 0, which logs the table and writes ``save_dir/memory_breakdown.json``."""
    ranks = gather(record)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    doc = {"update": update, "device": device.type, "units": "bytes",
           "categories": list(record["at_peak"]),
           "ranks": [dict(rank=i, **r) for i, r in enumerate(ranks)]}
    logger.info("\n" + table(doc))
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
        with open(os.path.join(save_dir, FILE_NAME), "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def table(doc: dict) -> str:
    """The breakdown as text: a row per category and top module, a column per rank; each cell
    is 'bytes at the rank's peak / the row's own max', in MiB (KiB for small models)."""
    ranks = doc["ranks"]
    biggest = max(r["peak_bytes"] for r in ranks)
    unit, div = ("MiB", 2 ** 20) if biggest >= 2 ** 20 else ("KiB", 2 ** 10)

    def cell(at: int, mx: int) -> str:
        return f"{at / div:,.2f} / {mx / div:,.2f}"

    rows = [("", *[f"rank {r['rank']}" for r in ranks]),
            ("peak (tracked)", *[f"{r['peak_bytes'] / div:,.2f}" for r in ranks]),
            ("peak during", *[f"{r['peak_phase']} {r['peak_module']}".strip() for r in ranks])]
    for c in doc["categories"]:
        rows.append((c, *[cell(r["at_peak"][c], r["max"][c]) for r in ranks]))
    order: dict[str, int] = {}
    for r in ranks:
        for m in r["top_modules"]:
            order[m["module"]] = max(order.get(m["module"], 0), m["at_peak"])
    if order:
        rows.append((f"top modules ({unit})", *[""] * len(ranks)))
    for name in sorted(order, key=lambda n: -order[n]):
        cells = []
        for r in ranks:
            found = next((m for m in r["top_modules"] if m["module"] == name), None)
            cells.append(cell(found["at_peak"], found["max"]) if found else "-")
        rows.append(("  " + name, *cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    head = (f"memory breakdown of update {doc['update']} on {doc['device']} ({unit}; each "
            f"cell: at the rank's peak / the row's own max over the update)")
    return "\n".join([head, *lines])
