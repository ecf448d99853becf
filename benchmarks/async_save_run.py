"""Synchronous vs asynchronous checkpoints, side by side in one run (not a test): the same
2-rank FSDP2 training, saving every few updates, once without and once with
`--write-checkpoints-asynchronously`.

The model: the NLLB layout (256,206-word shared vocabulary, pre-norm, sinusoidal positions) with
few, narrow layers, so that the checkpoint (fp32 weights and Adam's two moments) is large
against an update's compute: its synchronous save takes seconds. Measured on every rank: the
time the training loop is blocked in fairseq's save_checkpoint at each save point (for the
asynchronous run: of which waiting for the previous save to finish) and in each optimizer
step's wait for the staging copy, the rank's shards of the checkpoint (the bytes the staging
copy holds) and its resident memory after the last update; on rank 0 how long each background
write took; each run's per-update losses and gradient norms, per-rank peak memory
(mem_peak_gb_max), seconds per update and wall time.

Replaces the section between the markers in docs/benchmarks.md. The ranks' timers:
async_save_timers.py; scripts/benchmark_async_save.py parses the arguments (main's ``args``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path

from fairseq_fsdp2.estimator.from_args import build_meta_model, parse
from .harness import (launch, measured_or_saved, parse_records, replace_section,
                      stop_if_a_rank_failed, train_args, versions)

BEGIN, END = "<!-- async-save: begin -->", "<!-- async-save: end -->"
ASYNC = "--write-checkpoints-asynchronously"
BACKGROUND = re.compile(r"wrote .* \(update (\d+)\) in the background, ([\d.]+) s after")
TIMERS = "benchmarks.async_save_timers"


def model_flags(layers: int, dim: int) -> list[str]:
    return ["--arch", "transformer_nllb_600m", "--encoder-layers", str(layers),
            "--decoder-layers", str(layers), "--encoder-embed-dim", str(dim),
            "--decoder-embed-dim", str(dim), "--encoder-ffn-embed-dim", str(4 * dim),
            "--decoder-ffn-embed-dim", str(4 * dim), "--encoder-attention-heads",
            str(dim // 64), "--decoder-attention-heads", str(dim // 64)]


def training(data: Path, save_dir: Path, args, background: bool) -> list[str]:
    flags = train_args(data, model_flags(args.layers, args.dim),
                       ["--ddp-backend", "fsdp2", "--min-params-to-wrap", "1"],
                       args.max_tokens, args.updates, save_dir)
    flags = [f for f in flags if f != "--no-save"]
    return flags + ["--save-interval-updates", str(args.save_every), "--no-epoch-checkpoints",
                    "--fsdp2-no-consolidate"] + ([ASYNC] if background else [])


def run(name: str, data: Path, work: Path, args, background: bool) -> dict:
    save_dir = work / name
    if save_dir.exists():
        import shutil
        shutil.rmtree(save_dir)
    flags = training(data, save_dir, args, background)
    t0 = time.time()
    results = launch(args.ranks, lambda rank: flags, args.timeout,
                     preload=[TIMERS])
    wall = time.time() - t0
    stop_if_a_rank_failed(results, name)
    lines = {kind: [json.loads(line[5:]) for _, out in results for line in out.splitlines()
                    if line.startswith(kind + " ")] for kind in ("SAVE", "STEP")}
    # the end of training's wait: each rank's last WAIT line, after its last save
    end_waits = [float(json.loads(out[out.rindex("WAIT ") + 5:].splitlines()[0])["s"])
                 for _, out in results if "WAIT " in out[out.rindex("SAVE "):]]
    records = parse_records(results[0][1])
    return {"name": name, "wall_s": round(wall, 1), "saves": lines["SAVE"],
            "end_wait_s": end_waits,
            "background_s": [float(m.group(2)) for m in BACKGROUND.finditer(results[0][1])],
            "losses": {r["num_updates"]: [r["loss"], r["gnorm"]] for r in records},
            "peak_gb": max(float(r["mem_peak_gb_max"]) for r in records
                           if int(r["num_updates"]) >= 2),
            "seconds_per_update": statistics.median(s["s"] for s in lines["STEP"]
                                                    if s["update"] >= 2),
            "staging_waits": [s["staging_wait_s"] for s in lines["STEP"]],
            "last_rss_gb": [max((s for s in lines["STEP"] if s["rank"] == rank),
                                key=lambda s: s["update"])["rss_gb"]
                            for rank in range(args.ranks)]}


def summary(row: dict) -> dict:
    """The figures of one run's rows of the table."""
    saves = row["saves"]
    return {"blocked": statistics.median(s["blocked_s"] for s in saves),
            "blocked_max": max(s["blocked_s"] for s in saves),
            "waited_max": max(s["waited_s"] for s in saves),
            "staging_wait_max": max(row["staging_waits"]),
            "last_rss": statistics.median(row["last_rss_gb"]),
            "shards": statistics.median(s["shards_gb"] for s in saves),
            "count": len({s["update"] for s in saves})}


def report(rows: dict, info: dict, setup: dict) -> str:
    sync, background = summary(rows["sync"]), summary(rows["async"])
    share = background["blocked"] / sync["blocked"]
    same = rows["sync"]["losses"] == rows["async"]["losses"]
    bg = rows["async"]["background_s"]
    lines = [
        BEGIN, "## Asynchronous checkpoints: training blocked per save", "",
        f"Command: `{setup['command']}` ({setup['date']}). Machine: {info['cores']} cores "
        f"({info['cpu']}), {info['memory_gib']} GiB; Python {info['python']}, torch "
        f"{info['torch']}, fairseq-fixed {info['fairseq']}; gloo, fp32, Adam; load average "
        f"{setup['load']:.1f} at the start. The NLLB layout (256,206-word shared vocabulary) with "
        f"{setup['layers']}+{setup['layers']} layers of width {setup['dim']} "
        f"({setup['params'] / 1e6:.1f}M parameters), {setup['ranks']} ranks, FSDP2 per-layer, "
        f"`--max-tokens {setup['max_tokens']}` per rank, {setup['updates']} updates, a save "
        f"every {setup['save_every']} (`--save-interval-updates`, {sync['count']} saves), the "
        f"same run without and with `{ASYNC}`, one after the other. Blocked: the time each "
        f"rank's training loop spent in fairseq's save_checkpoint (median over ranks and saves), "
        f"and, asynchronously, in the next optimizer step's wait for the staging copy (made "
        f"meanwhile by a thread of its own).",
        "", "| | synchronous | asynchronous |", "|---|---:|---:|",
        f"| training blocked per save, median (max) | {sync['blocked']:.2f} s "
        f"({sync['blocked_max']:.2f}) | {background['blocked']:.2f} s "
        f"({background['blocked_max']:.2f}) |",
        f"| of which waiting for the previous save (max) | - | {background['waited_max']:.2f} s |",
        f"| the next optimizer step's wait for the staging copy (max) | - | "
        f"{background['staging_wait_max']:.2f} s |",
        f"| background write, save point to files written (rank 0, median) | - | "
        f"{statistics.median(bg):.2f} s |" if bg else "| background write | - | - |",
        f"| waiting for the last save at the end of training (max over ranks) | - | "
        f"{max(rows['async']['end_wait_s'] or [0]):.2f} s |",
        f"| resident memory per rank after the last update (VmRSS, median over ranks) | "
        f"{sync['last_rss']:.3f} GiB | {background['last_rss']:.3f} GiB |",
        f"| the rank's shards of the checkpoint (what the staging copy holds) | "
        f"{sync['shards']:.3f} GiB | {background['shards']:.3f} GiB |",
        f"| per-rank peak over the run (mem_peak_gb_max, from update 2) | "
        f"{rows['sync']['peak_gb']:.3f} GiB | {rows['async']['peak_gb']:.3f} GiB |",
        f"| seconds per update, median | {rows['sync']['seconds_per_update']:.2f} | "
        f"{rows['async']['seconds_per_update']:.2f} |",
        f"| the run, wall clock | {rows['sync']['wall_s']:.0f} s | {rows['async']['wall_s']:.0f} s |",
        "",
        f"Blocked asynchronously: {100 * share:.1f}% of the synchronous save (goal: at most "
        f"10%: {'met' if share <= 0.10 else 'NOT met'}). Per-update losses and gradient norms "
        f"of the two runs: {'identical' if same else 'DIFFERENT'} ({len(rows['sync']['losses'])} "
        f"updates). The asynchronous run keeps its staging copy (one copy of the rank's "
        f"shards) from the first save on, hence its larger resident memory and peak; its copy "
        f"and write take CPU time from training on these {info['cores']} cores (seconds per "
        f"update also vary with the machine's load, which other work set).", "", END]
    return "\n".join(lines)


def main(args: argparse.Namespace, command: str) -> int:
    """Run both (or, with --report-only, reload them), replace the section of --out, save the
    rows (benchmark_async_save.json in --work); ``command`` is what the report records."""
    def measure(data: Path, work: Path) -> dict:
        model = build_meta_model(parse(training(data, work / "x", args, False)))
        setup = {**{k: getattr(args, k) for k in ("ranks", "layers", "dim", "max_tokens",
                                                   "updates", "save_every")},
                 "params": sum(p.numel() for p in model.parameters()),
                 "load": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d"),
                 "command": command}
        del model
        rows = {name: run(name, data, work, args, name == "async")
                for name in ("sync", "async")}
        return {"rows": rows, "setup": setup}

    saved = measured_or_saved(args, "benchmark_async_save.json", measure)
    text = report(saved["rows"], versions(), saved["setup"])
    replace_section(Path(args.out), BEGIN, END, text)
    print(text)
    return 0
