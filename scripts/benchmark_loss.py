#!/usr/bin/env python
"""The vocabulary loss, side by side (not a test): fairseq's stock label_smoothed_cross_entropy
against the fused chunked loss at several --loss-chunk-tokens, on the NLLB-shaped reduced model
of scripts/benchmark.py (256,206-word vocabulary), FSDP2 per-layer, root reshard always, the
tied-gradient buffer (the recipe's settings), at 1 and 2 ranks, in one run.

Each row: per-rank peak (largest logged mem_peak_gb_max from update 2 on, all ranks), median
words/s from update 2 on, the estimator's prediction, and the all-gathers of the shared embedding
in one update (torch.profiler, tests/probes/count_all_gathers.py). With --baseline-plugin DIR (a
copy of an earlier fairseq_fsdp2, e.g. ``git archive main fairseq_fsdp2 | tar -x -C /tmp/old``)
the earlier chunked loss (logits recomputed in backward) runs too, at the same chunk sizes.

Replaces the section between the markers in docs/benchmarks.md.

  .venv/bin/python scripts/benchmark_loss.py --baseline-plugin /tmp/old/fairseq_fsdp2
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark as bench  # noqa: E402  (scripts/benchmark.py: corpus, launch, worker)

ROOT = bench.ROOT
BEGIN, END = "<!-- loss sweep: begin -->", "<!-- loss sweep: end -->"
BASE = ["--ddp-backend", "fsdp2", "--min-params-to-wrap", "1", "--fsdp2-root-reshard", "always"]
PROBES = str(ROOT / "tests" / "probes")


def config(criterion: str, chunk: int = 0) -> list[str]:
    if not chunk:
        return BASE + ["--criterion", criterion]
    return BASE + ["--criterion", criterion, "--loss-chunk-tokens", str(chunk)]


def run(name: str, flags: list[str], world: int, data: Path, work: Path, args,
        plugin: str = bench.PLUGIN) -> dict:
    train = bench.train_args(data, bench.REDUCED, flags, args.max_tokens, args.updates,
                             work / "unused") + ["--user-dir", plugin]
    row = {"config": name, "world_size": world}
    if plugin == bench.PLUGIN:
        from fairseq_fsdp2 import estimate as estimator
        (prediction,) = estimator.estimate_args(train + ["--world-size", str(world),
                                                         "--seq-len", str(bench.SEQ)])
        row["predicted_gb"] = round(prediction.peak_gb, 3)
    env = {"PYTHONPATH": os.pathsep.join([str(Path(plugin).parent), PROBES]),
           "COUNT_UPDATE": str(args.updates)}  # the last update: not in the medians
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.time()
        results = bench.launch(world, lambda rank: train, args.timeout)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    row["wall_s"] = round(time.time() - t0, 1)
    if any(rc != 0 for rc, _ in results):
        rc, out = next((rc, out) for rc, out in results if rc != 0)
        row["error"] = f"exit {rc}"
        print(f"  FAILED {name} x {world}\n{out[-3000:]}", flush=True)
        return row
    output = results[0][1]
    records = [r for r in bench.parse_records(output)
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


def worker_with_probe(argv: list[str]) -> None:
    import count_all_gathers  # noqa: F401  (installs the all-gather count on Trainer)
    bench.worker(argv)


def report(rows: list[dict], args, info: dict, load: str) -> str:
    lines = [BEGIN, "## The vocabulary loss: stock vs fused chunked, chunk-size sweep", "",
             f"Written by `scripts/benchmark_loss.py` (one run, rows interleaved per rank count). "
             f"Command: `{shlex.join(['.venv/bin/python', 'scripts/benchmark_loss.py', *sys.argv[1:]])}` "
             f"({time.strftime('%Y-%m-%d')}). Machine: "
             f"{info['cores']} cores ({info['cpu']}), {info['memory_gib']} GiB; Python "
             f"{info['python']}, torch {info['torch']}, fairseq-fixed {info['fairseq']}; fp32, "
             f"Adam. The reduced NLLB-shaped model above, `--max-tokens {args.max_tokens}` per "
             f"rank ({args.max_tokens // bench.SEQ} sentences of {bench.SEQ} tokens), "
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
                         f"{bench.ratio(wps, stock_wps)} | "
                         f"{done[0].get('embedding_all_gathers') or '-'} |")
    return "\n".join(lines + ["", END])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/fairseq_fsdp2_benchmark")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--max-tokens", type=int, default=64 * bench.SEQ)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline-chunks", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--baseline-plugin", default=None,
                        help="an earlier fairseq_fsdp2 directory: its chunked loss runs too")
    parser.add_argument("--timeout", type=float, default=1200)
    return parser


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_with_probe(sys.argv[2:])
        return 0
    args = build_parser().parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sentences = args.updates * max(args.ranks) * (args.max_tokens // bench.SEQ) + 400
    data = bench.make_corpus(work / f"corpus{sentences}", sentences)
    bench_path = Path(bench.__file__).resolve()
    bench_file = Path(__file__).resolve()
    # the workers run this script (its --worker installs the all-gather count)
    bench.__file__ = str(bench_file)
    configs = [("stock", config("label_smoothed_cross_entropy"), bench.PLUGIN)]
    configs += [(f"fused, {n} tokens", config("label_smoothed_cross_entropy_chunked", n),
                 bench.PLUGIN) for n in args.chunks]
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
                rows.append(run(name, flags, world, data, work, args, plugin))
    print(f"loss benchmark: {time.time() - started:.0f}s", flush=True)
    bench.__file__ = str(bench_path)
    load = (f"1-minute load average {min(loads):.1f} to {max(loads):.1f} on "
            f"{os.cpu_count()} cores at the rows' starts (the benchmark's own ranks included)")
    text = report(rows, args, bench.versions(), load)
    bench.replace_section(Path(args.out), BEGIN, END, text)
    (work / "benchmark_loss.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
