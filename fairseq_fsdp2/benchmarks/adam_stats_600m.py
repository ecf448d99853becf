"""How Adam's moments are kept, at the real NLLB-600M dimensions on 2 CPU ranks (not a test):
fp32 moments, ``--bf16-adam-stats`` and ``--eight-bit-adam-stats``, each with ``--bf16``
compute and the recipe's memory settings (benchmarks/nllb600m.py's ``recipe``), ``--max-tokens
512`` per rank, 2 updates.

Each rank's peak resident memory is measured from outside the process, as a scheduler sees it:
GNU time's maximum RSS of each rank's process, with ``--log-interval`` longer than the run (the
plugin resets the kernel's high-water mark at every log interval: docs/memory.md). Beside each,
the estimator's prediction for the same command line. fp16 compute is not measured: on CPU it
does not finish an update of this size in 25 minutes (shared/notes); bf16 holds the same bytes.

Replaces the section between the markers in docs/benchmarks.md; scripts/benchmark_adam_stats_600m.py
parses the arguments.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

from .harness import (NLLB_600M, SEQ, launch, measured_or_saved, predicted, replace_section,
                      stop_if_a_rank_failed, train_args, versions)
from .nllb600m import RECIPE_CHUNK, recipe

BEGIN, END = "<!-- adam-stats-600m: begin -->", "<!-- adam-stats-600m: end -->"
EIGHT_BIT_FLAG = "--eight-bit-adam-stats"
#: each setting's flags on top of the common command line
SETTINGS = {"fp32 moments": [], "--bf16-adam-stats": ["--bf16-adam-stats"],
            EIGHT_BIT_FLAG: [EIGHT_BIT_FLAG]}
COMMON = ["--bf16", "--log-interval", "1000"]
TIME = ["/usr/bin/time", "-f", "benchmark: max RSS %M KB"]
RSS = re.compile(r"benchmark: max RSS (\d+) KB")
KIB_PER_GIB = 2 ** 20


def command(data: Path, work: Path, args, flags: list[str]) -> list[str]:
    return train_args(data, NLLB_600M, recipe(RECIPE_CHUNK) + COMMON + flags, args.max_tokens,
                      args.updates, work / "unused")


def measure_setting(data: Path, work: Path, args, flags: list[str]) -> dict:
    train = command(data, work, args, flags)
    prediction = predicted(train, args.ranks)
    t0 = time.time()
    results = launch(args.ranks, lambda rank: train, args.timeout, wrapper=TIME)
    stop_if_a_rank_failed(results)
    peaks = []
    for _, out in results:
        found = RSS.findall(out)
        assert len(found) == 1, out[-2000:]
        peaks.append(round(int(found[0]) / KIB_PER_GIB, 3))
    return {"peaks_gb": peaks, "predicted_gb": round(prediction.peak_gb, 3),
            "predicted_moment": prediction.classes[0].moment,
            "wall_s": round(time.time() - t0, 1), "load": os.getloadavg()[0]}


def report(rows: dict, info: dict, meta: dict) -> str:
    lines = [
        BEGIN, "## Adam's moments in 32, 16 and 8 bits: real NLLB-600M dimensions, 2 ranks", "",
        f"Command: `{meta['command']}` ({meta['date']}). Machine: {info['cores']} cores "
        f"({info['cpu']}), {info['memory_gib']} GiB; Python {info['python']}, torch "
        f"{info['torch']}, fairseq-fixed {info['fairseq']}; gloo. `transformer_nllb_600m` "
        f"(615.1M parameters, 256,206-word vocabulary), {meta['ranks']} ranks, the recipe's "
        f"memory settings (FSDP2 per-layer, `--fsdp2-root-reshard always`, the chunked loss of "
        f"{RECIPE_CHUNK} tokens, the tied-gradient buffer), `--bf16`, Adam, `--max-tokens "
        f"{meta['max_tokens']}` per rank, {meta['updates']} updates, `--log-interval 1000`. "
        f"Measured from outside: GNU time's maximum resident set of each rank's process "
        f"(`/usr/bin/time -f %M`). Predicted: `python -m fairseq_fsdp2.estimate` with the "
        f"same command line, `--world-size {meta['ranks']} --seq-len {SEQ}`.", "",
        "| Adam's moments | rank 0 GiB | rank 1 GiB | predicted GiB |",
        "|---|---:|---:|---:|"]
    for name, row in rows.items():
        cells = " | ".join(f"{p:.2f}" for p in row["peaks_gb"])
        lines.append(f"| {name} | {cells} | {row['predicted_gb']:.2f} |")
    if EIGHT_BIT_FLAG in rows and "--bf16-adam-stats" in rows:
        saved = max(rows["--bf16-adam-stats"]["peaks_gb"]) - max(rows[EIGHT_BIT_FLAG]["peaks_gb"])
        lines += ["", f"8-bit moments save {saved:.2f} GiB per rank against 16-bit ones (a byte "
                      f"per moment element less: 615.1M x 2 bytes / {meta['ranks']} ranks = "
                      f"{615.1e6 * 2 / meta['ranks'] / 2 ** 30:.2f} GiB, less the block maxima)."]
    lines += ["", "The estimator places each peak at "
              + "; ".join(f"{name}: {row['predicted_moment']}" for name, row in rows.items())
              + ".", "", END]
    return "\n".join(lines)


def main(args: argparse.Namespace, command_line: str) -> int:
    """Measure every setting (or reload them, --report-only), replace the section of --out, save
    the rows (benchmark_adam_stats_600m.json in --work)."""
    def measure(data: Path, work: Path) -> dict:
        rows = {name: measure_setting(data, work, args, flags)
                for name, flags in SETTINGS.items()}
        return {"rows": rows, "meta": {"command": command_line, "date": time.strftime("%Y-%m-%d"),
                                       "ranks": args.ranks, "max_tokens": args.max_tokens,
                                       "updates": args.updates}}

    saved = measured_or_saved(args, "benchmark_adam_stats_600m.json", measure)
    text = report(saved["rows"], versions(), saved["meta"])
    replace_section(Path(args.out), BEGIN, END, text)
    print(text)
    return 0
