"""The vocabulary loss, side by side (not a test): fairseq's stock label_smoothed_cross_entropy
against the fused chunked loss at several --loss-chunk-tokens, on the NLLB-shaped reduced model
(harness.REDUCED, 256,206-word vocabulary), FSDP2 per-layer, root reshard always, the
tied-gradient buffer (the recipe's settings), at 1 and 2 ranks, in one run.

Each row: per-rank peak (largest logged mem_peak_gb_max from update 2 on, all ranks), median
words/s from update 2 on, the estimator's prediction, and the all-gathers of the shared embedding
in the last update, counted by a probe (tests/probes/count_all_gathers.py: imported by every rank
before training; rank 0 prints one line). With a baseline plugin (a copy of an earlier
fairseq_fsdp2) its chunked loss runs too, at the same chunk sizes.

Replaces the section between the markers in docs/benchmarks.md. scripts/benchmark_loss.py
parses the arguments (main's ``args``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from .harness import (PLUGIN, REDUCED, SEQ, failed_rank, launch, make_corpus, parse_records,
                      predicted, ratio, replace_section, train_args, versions)

BEGIN, END = "<!-- loss sweep: begin -->", "<!-- loss sweep: end -->"
BASE = ["--ddp-backend", "fsdp2", "--min-params-to-wrap", "1", "--fsdp2-root-reshard", "always"]


def config(criterion: str, chunk: int = 0) -> list[str]:
    if not chunk:
        return BASE + ["--criterion", criterion]
    return BASE + ["--criterion", criterion, "--loss-chunk-tokens", str(chunk)]


def run(name: str, flags: list[str], world: int, data: Path, work: Path, args, probe: Path,
        plugin: str = PLUGIN) -> dict:
    """One configuration at one world size, with the all-gather probe in every rank: a row.

    The probe is imported by name from PYTHONPATH. This checkout's plugin runs under the
    worker (harness.launch); another plugin (``plugin``) runs with the probe itself as the
    program (it runs fairseq-train), because fairseq refuses a --user-dir whose package name
    is already imported, and the worker's process has imported this checkout's package."""
    train = train_args(data, REDUCED, flags, args.max_tokens, args.updates,
                       work / "unused") + ["--user-dir", plugin]
    row = {"config": name, "world_size": world}
    if plugin == PLUGIN:
        row["predicted_gb"] = round(predicted(train, world).peak_gb, 3)
    env = {"PYTHONPATH": os.pathsep.join([str(Path(plugin).parent), str(probe.parent)]),
           "COUNT_UPDATE": str(args.updates)}  # the last update: not in the medians
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.time()
        if plugin == PLUGIN:
            results = launch(world, lambda rank: train, args.timeout, preload=[probe.stem])
        else:
            results = launch(world, lambda rank: train, args.timeout,
                             program=[sys.executable, str(probe)])
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    row["wall_s"] = round(time.time() - t0, 1)
    failed = failed_rank(results)
    if failed is not None:
        rc, out = failed
        row["error"] = f"exit {rc}"
        print(f"  FAILED {name} x {world}\n{out[-3000:]}", flush=True)
        return row
    output = results[0][1]
    records = [r for r in parse_records(output)
               if 2 <= int(r["num_updates"]) < args.updates]
    row["peak_gb"] = max(float(r["mem_peak_gb_max"]) for r in records)
    row["wps"] = statistics.median(float(r["wps"]) for r in records)
    line = next((l for l in output.splitlines() if "all-gathers of update" in l), None)
    if line:
        counts = json.loads(line.split(": ", 1)[1])
        row["embedding_all_gathers"] = next((v for k, v in counts.items()
                                             if "embed_tokens" in k), None)
    print(f"  {name} x {world}: peak {row['peak_gb']:.3f} GiB (predicted "
          f"{row.get('predicted_gb', '-')}), {row['wps']:.0f} words/s, embedding all-gathers "
          f"{row.get('embedding_all_gathers')}, {row['wall_s']}s", flush=True)
    return row


def report(rows: list[dict], args, info: dict, load: str, command: str) -> str:
    """The section (markers included): one row per loss and rank count, medians of repeats."""
    lines = [BEGIN, "## The vocabulary loss: stock vs fused chunked, chunk-size sweep", "",
             f"Written by `scripts/benchmark_loss.py` (one run, rows interleaved per rank count). "
             f"Command: `{command}` "
             f"({time.strftime('%Y-%m-%d')}). Machine: "
             f"{info['cores']} cores ({info['cpu']}), {info['memory_gib']} GiB; Python "
             f"{info['python']}, torch {info['torch']}, fairseq-fixed {info['fairseq']}; fp32, "
             f"Adam. The reduced NLLB-shaped model above, `--max-tokens {args.max_tokens}` per "
             f"rank ({args.max_tokens // SEQ} sentences of {SEQ} tokens), "
             f"{args.updates} updates (the last one profiled for the all-gather count and left "
             f"out), FSDP2 per-layer, `--fsdp2-root-reshard always`, the "
             f"tied-gradient buffer. Words/s: median of the per-update values from update 2 on; "
             f"the per-rank peak: the largest over the same updates, all ranks; "
             f"each configuration is repeated {args.repeats} time(s) and the median of those "
             f"medians shown. Load while it ran: {load}.", "",
             "| loss | ranks | per-rank peak GiB | predicted GiB | words/s | vs stock | "
             "embedding all-gathers per update |", "|---|---:|---:|---:|---:|---:|---:|"]
    for world in sorted({r["world_size"] for r in rows}):
        group = [r for r in rows if r["world_size"] == world]
        names = list(dict.fromkeys(r["config"] for r in group))
        stock = [r for r in group if r["config"] == "stock" and r.get("wps")]
        stock_wps = statistics.median(r["wps"] for r in stock) if stock else None
        for name in names:
            done = [r for r in group if r["config"] == name and r.get("wps")]
            if not done:
                lines.append(f"| {name} | {world} | failed | - | - | - | - |")
                continue
            wps = statistics.median(r["wps"] for r in done)
            peak = max(r["peak_gb"] for r in done)
            pred = done[0].get("predicted_gb")
            lines.append(f"| {name} | {world} | {peak:.2f} | "
                         f"{f'{pred:.2f}' if pred else '-'} | {wps:.0f} | "
                         f"{ratio(wps, stock_wps)} | "
                         f"{done[0].get('embedding_all_gathers') or '-'} |")
    return "\n".join(lines + ["", END])


def main(args: argparse.Namespace, command: str, probe: Path) -> int:
    """Run the sweep that ``args`` asks for, replace its section of --out, save the rows
    (benchmark_loss.json in --work); ``command`` is what the report records, ``probe`` the
    all-gather counter (tests/probes/count_all_gathers.py)."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sentences = args.updates * max(args.ranks) * (args.max_tokens // SEQ) + 400
    data = make_corpus(work / f"corpus{sentences}", sentences)
    configs: list[tuple[str, list[str], str]]  # name, flags, plugin directory
    configs = [("stock", config("label_smoothed_cross_entropy"), PLUGIN)]
    configs += [(f"fused, {n} tokens", config("label_smoothed_cross_entropy_chunked", n),
                 PLUGIN) for n in args.chunks]
    if args.baseline_plugin:
        configs += [(f"recompute (earlier), {n} tokens",
                     config("label_smoothed_cross_entropy_chunked", n), args.baseline_plugin)
                    for n in args.baseline_chunks]
    rows, loads = [], []
    started = time.time()
    for world in args.ranks:
        for _ in range(args.repeats):
            for name, flags, plugin in configs:
                loads.append(os.getloadavg()[0])
                rows.append(run(name, flags, world, data, work, args, probe, plugin))
    print(f"loss benchmark: {time.time() - started:.0f}s", flush=True)
    load = (f"1-minute load average {min(loads):.1f} to {max(loads):.1f} on "
            f"{os.cpu_count()} cores at the rows' starts (the benchmark's own ranks included)")
    text = report(rows, args, versions(), load, command)
    replace_section(Path(args.out), BEGIN, END, text)
    (work / "benchmark_loss.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0
