"""LoRA against full fine-tuning at the real NLLB-600M dimensions on 2 CPU ranks (not a test):
``--lora-rank 16 --lora-alpha 32`` (the default modules: attention q/k/v/out and fc1/fc2 of
every layer) and full fine-tuning with ``--eight-bit-adam-stats`` (the cheapest full
fine-tuning), each with ``--bf16`` compute and the recipe's memory settings
(benchmarks/nllb600m.py's ``recipe``), ``--max-tokens 512`` per rank, 2 updates, side by side in
one run.

Each rank's peak resident memory is measured from outside the process (GNU time's maximum RSS,
``--log-interval`` longer than the run: adam_stats_600m.py says why), beside the estimator's
prediction for the same command line (computed when the report is written, so ``--report-only``
gives the current estimator's); words per second from fairseq's end-of-epoch record (both
updates). Replaces the section between the markers in docs/benchmarks.md;
scripts/benchmark_lora_600m.py parses the arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .adam_stats_600m import COMMON, KIB_PER_GIB, RSS, TIME
from .harness import (NLLB_600M, SEQ, launch, measured_or_saved, predicted,
                      replace_section, stop_if_a_rank_failed, train_args, versions)
from .nllb600m import RECIPE_CHUNK, recipe

BEGIN, END = "<!-- lora-600m: begin -->", "<!-- lora-600m: end -->"
LORA = ["--lora-rank", "16", "--lora-alpha", "32"]
SETTINGS = {"LoRA, " + " ".join(LORA): LORA,
            "full fine-tuning, --eight-bit-adam-stats": ["--eight-bit-adam-stats"]}


def command(data: Path, work: Path, args, flags: list[str]) -> list[str]:
    return train_args(data, NLLB_600M, recipe(RECIPE_CHUNK) + COMMON + flags, args.max_tokens,
                      args.updates, work / "unused")


def measure_setting(data: Path, work: Path, args, flags: list[str]) -> dict:
    t0 = time.time()
    results = launch(args.ranks, lambda rank: command(data, work, args, flags), args.timeout,
                     wrapper=TIME)
    stop_if_a_rank_failed(results)
    peaks = []
    for _, out in results:
        found = RSS.findall(out)
        assert len(found) == 1, out[-2000:]
        peaks.append(round(int(found[0]) / KIB_PER_GIB, 3))
    summary = [json.loads(line.split("| train | ", 1)[1]) for line in results[0][1].splitlines()
               if "| train | {" in line]
    return {"flags": flags, "peaks_gb": peaks, "wall_s": round(time.time() - t0, 1),
            "wps": float(summary[-1]["train_wps"]) if summary else None,
            "load": os.getloadavg()[0]}


def report(rows: dict, info: dict, meta: dict, work: Path, args) -> str:
    lines = [
        BEGIN, "## LoRA against full fine-tuning: real NLLB-600M dimensions, 2 ranks", "",
        f"Command: `{meta['command']}` ({meta['date']}). Machine: {info['cores']} cores "
        f"({info['cpu']}), {info['memory_gib']} GiB; Python {info['python']}, torch "
        f"{info['torch']}, fairseq-fixed {info['fairseq']}; gloo. `transformer_nllb_600m` "
        f"(615.1M parameters, 256,206-word vocabulary), {meta['ranks']} ranks, the recipe's "
        f"memory settings (FSDP2 per-layer, `--fsdp2-root-reshard always`, the chunked loss of "
        f"{RECIPE_CHUNK} tokens, the tied-gradient buffer), `--bf16`, Adam, `--max-tokens "
        f"{meta['max_tokens']}` per rank, {meta['updates']} updates from a random "
        f"initialisation, `--log-interval 1000`, the settings run one after the other in one "
        f"run. Peak: GNU time's maximum resident set of each rank's process "
        f"(`/usr/bin/time -f %M`). Predicted: `python -m fairseq_fsdp2.estimate` with the same "
        f"command line, `--world-size {meta['ranks']} --seq-len {SEQ}`. Words per second: "
        f"fairseq's end-of-epoch `train_wps` (both updates).", "",
        "| setting | rank 0 GiB | rank 1 GiB | predicted GiB | words/s | wall s | load |",
        "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        cells = " | ".join(f"{p:.2f}" for p in row["peaks_gb"])
        try:
            guess = f"{predicted(command(Path('DATA'), work, args, row['flags']), meta['ranks']).peak_gb:.2f}"
        except Exception as e:  # noqa: BLE001 - shown in the table, not hidden
            guess = f"({type(e).__name__})"
        wps = f"{row['wps']:.0f}" if row.get("wps") else "-"
        lines.append(f"| {name} | {cells} | {guess} | {wps} | {row['wall_s']:.0f} | "
                     f"{row['load']:.1f} |")
    lines += ["", END]
    return "\n".join(lines)


def main(args: argparse.Namespace, command_line: str) -> int:
    """Measure both settings (or reload them, --report-only), replace the section of --out,
    save the rows (benchmark_lora_600m.json in --work)."""
    def measure(data: Path, work: Path) -> dict:
        rows = {name: measure_setting(data, work, args, flags)
                for name, flags in SETTINGS.items()}
        return {"rows": rows, "meta": {"command": command_line, "date": time.strftime("%Y-%m-%d"),
                                       "ranks": args.ranks, "max_tokens": args.max_tokens,
                                       "updates": args.updates}}

    saved = measured_or_saved(args, "benchmark_lora_600m.json", measure)
    text = report(saved["rows"], versions(), saved["meta"], Path(args.work), args)
    replace_section(Path(args.out), BEGIN, END, text)
    print(text)
    return 0
