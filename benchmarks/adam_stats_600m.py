"""How Adam's moments are kept, at the real NLLB-600M dimensions on 2 CPU ranks (not a test):
fp32 moments, ``--bf16-adam-stats`` and ``--eight-bit-adam-stats``, each with ``--bf16``
compute and the recipe's memory settings (benchmarks/nllb600m.py's ``recipe``), ``--max-tokens
512`` per rank, 4 updates.

Each rank's peak resident memory is measured from outside the process, as a scheduler sees it:
GNU time's maximum RSS of each rank's process, with ``--log-interval`` longer than the run (the
plugin resets the kernel's high-water mark at every log interval: docs/memory.md). Beside each,
the estimator's prediction for the same command line. And the time: seconds per update and the
optimizer step's own seconds (update_timers.py, imported by each rank first, prints them), the
median over the updates after the first (the first creates the moments), the slower rank's; as
wall time and as the rank's CPU time, which the other processes of a shared machine do not
inflate (the ratios against fp32 moments are taken on CPU time). fp16 compute is not measured: on CPU it
does not finish an update of this size in 25 minutes (shared/notes); bf16 holds the same bytes.

With ``--rounds N`` the settings run in turn N times (fp32, 8-bit, fp32, 8-bit, ...): a setting's
figures are the medians over its rounds, and its ratio against fp32 moments the median of the
ratios within a round. One run per setting, one after the other, is not enough on a shared VM:
the same code's CPU time per update outside the step moved by up to 20% between them.

Replaces the section between the markers in docs/benchmarks.md; scripts/benchmark_adam_stats_600m.py
parses the arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from .harness import (NLLB_600M, SEQ, TIME, launch, measured_or_saved, peaks_gb, predicted,
                      replace_section, stop_if_a_rank_failed, train_args, versions)
from .nllb600m import RECIPE_CHUNK, recipe, recipe_run_described

BEGIN, END = "<!-- adam-stats-600m: begin -->", "<!-- adam-stats-600m: end -->"
EIGHT_BIT_FLAG = "--eight-bit-adam-stats"
#: each setting's flags on top of the common command line
NARROW_FLAGS = [EIGHT_BIT_FLAG, "--fsdp2-reduce-dtype", "bf16"]
#: bf16 weights with no fp32 master copy (settings.keeps_bf16_weights)
BF16_WEIGHTS_FLAG = "--memory-efficient-bf16"
IN_BACKWARD_FLAG = "--fsdp2-step-in-backward"
#: each setting (by the name --settings takes): its row's label and its flags on top of the
#: common command line
SETTINGS = {"fp32": ("fp32 moments", []),
            "bf16": ("--bf16-adam-stats", ["--bf16-adam-stats"]),
            "8bit": (EIGHT_BIT_FLAG, [EIGHT_BIT_FLAG]),
            # the optimizer step's memory settings: 8-bit moments and the bf16 gradient shards
            # kept for the step (sharding/sixteen_bit_grads.py)
            "8bit-bf16-grads": (" ".join(NARROW_FLAGS), NARROW_FLAGS),
            # and bf16 weights with no fp32 master (--memory-efficient-bf16: stochastic rounding)
            "bf16-weights": (" ".join([BF16_WEIGHTS_FLAG, *NARROW_FLAGS]),
                             [BF16_WEIGHTS_FLAG, *NARROW_FLAGS]),
            # and Adam stepped inside backward (optimizer/step_in_backward.py; the harness's
            # command has no --clip-norm: fairseq's default 0, as the step in backward needs)
            "bf16-weights-in-backward": (
                " ".join([BF16_WEIGHTS_FLAG, *NARROW_FLAGS, IN_BACKWARD_FLAG]),
                [BF16_WEIGHTS_FLAG, *NARROW_FLAGS, IN_BACKWARD_FLAG])}
COMMON = ["--bf16", "--log-interval", "1000"]
#: imported by each rank first: prints an UPDATE line per update (its PREFIX; not imported
#: here, as importing it patches fairseq's Trainer)
TIMERS = "benchmarks.update_timers"
UPDATE = "UPDATE "
#: the times a run reports (timings), each the median over updates 2 onward
TIMED = ("update_s", "step_s", "update_cpu_s", "step_cpu_s")


def timings(outputs: list[str]) -> dict:
    """Seconds per update and the optimizer step's, wall and CPU (update_timers.py), each the
    median over the updates after the first, the slower rank's."""
    keys = {"update_s": "s", "step_s": "optimizer_s", "update_cpu_s": "cpu_s",
            "step_cpu_s": "optimizer_cpu_s"}
    per_rank = []
    for out in outputs:
        rows = [json.loads(line[len(UPDATE):]) for line in out.splitlines()
                if line.startswith(UPDATE)]
        later = [r for r in rows if r["update"] > 1]
        assert later, out[-2000:]
        per_rank.append({k: statistics.median(r[v] for r in later) for k, v in keys.items()})
    assert set(keys) == set(TIMED)
    return {**{k: round(max(r[k] for r in per_rank), 2) for k in keys},
            "updates_timed": len(later)}


def command(data: Path, work: Path, args, flags: list[str]) -> list[str]:
    return train_args(data, NLLB_600M, recipe(RECIPE_CHUNK) + COMMON + flags, args.max_tokens,
                      args.updates, work / "unused")


def measure_setting(data: Path, work: Path, args, flags: list[str]) -> dict:
    train = command(data, work, args, flags)
    prediction = predicted(train, args.ranks)
    t0 = time.time()
    results = launch(args.ranks, lambda rank: train, args.timeout, wrapper=TIME,
                     preload=[TIMERS])
    stop_if_a_rank_failed(results)
    peaks = peaks_gb(results)
    return {"peaks_gb": peaks, "predicted_gb": round(prediction.peak_gb, 3),
            **timings([out for _, out in results]),
            "predicted_moment": prediction.classes[0].moment,
            "wall_s": round(time.time() - t0, 1), "load": os.getloadavg()[0]}


def combined(runs: list[dict]) -> dict:
    """A setting's row from its rounds' runs: the largest peaks, the median times, and the
    runs themselves (for the ratios within a round)."""
    row = {k: statistics.median(run[k] for run in runs) for k in TIMED}
    row["peaks_gb"] = [max(peaks) for peaks in zip(*(run["peaks_gb"] for run in runs))]
    return {**runs[-1], **row, "runs": runs}


def against(row: dict, base: dict, key: str) -> float:
    """``row``'s ``key`` over ``base``'s: the median over rounds of the ratio within a round
    (a row saved before rounds existed: the one run's ratio)."""
    pairs = zip(row.get("runs", [row]), base.get("runs", [base]))
    return statistics.median(run[key] / first[key] for run, first in pairs)


def report(rows: dict, info: dict, meta: dict) -> str:
    lines = [
        BEGIN, "## Adam's moments in 32, 16 and 8 bits: real NLLB-600M dimensions, 2 ranks", "",
        recipe_run_described(info, meta) + ", `--log-interval 1000`. "
        f"Measured from outside: GNU time's maximum resident set of each rank's process "
        f"(`/usr/bin/time -f %M`). Predicted: `python -m fairseq_fsdp2.estimate` with the "
        f"same command line, `--world-size {meta['ranks']} --seq-len {SEQ}`. Time: each "
        f"update (fairseq's `train_step`) and the optimizer's step within it "
        f"(`FairseqOptimizer.step`), timed in each rank (`benchmarks/update_timers.py`): the "
        f"median over updates 2-{meta['updates']}, the slower rank's, as wall time and as the "
        f"rank's CPU time (`time.process_time`: not inflated by other processes on the "
        f"machine; waits in collectives do not count)"
        + (f"; the settings ran in turn {meta['rounds']} times, each figure the median over "
           f"the rounds and each ratio against fp32 moments the median of the ratios within a "
           f"round" if meta.get("rounds", 1) > 1 else "")
        + "; load average "
        + ", ".join(f"{row['load']:.1f}" for row in rows.values()) + " at the settings' ends.",
        "",
        "| Adam's moments | rank 0 GiB | rank 1 GiB | predicted GiB | s per update | "
        "CPU s per update | optimizer step s | optimizer step CPU s | update CPU vs fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fp32 = rows.get(SETTINGS["fp32"][0], {})
    base = fp32.get("update_cpu_s")
    for name, row in rows.items():
        cells = " | ".join(f"{p:.2f}" for p in row["peaks_gb"])
        timed = (f" {row['update_s']:.1f} | {row['update_cpu_s']:.1f} | {row['step_s']:.2f} | "
                 f"{row['step_cpu_s']:.2f} | {against(row, fp32, 'update_cpu_s'):.2f}x |"
                 if base else " - | - | - | - | - |")
        lines.append(f"| {name} | {cells} | {row['predicted_gb']:.2f} |{timed}")
    if EIGHT_BIT_FLAG in rows and "--bf16-adam-stats" in rows:
        saved = max(rows["--bf16-adam-stats"]["peaks_gb"]) - max(rows[EIGHT_BIT_FLAG]["peaks_gb"])
        lines += ["", f"8-bit moments save {saved:.2f} GiB per rank against 16-bit ones (a byte "
                      f"per moment element less: 615.1M x 2 bytes / {meta['ranks']} ranks = "
                      f"{615.1e6 * 2 / meta['ranks'] / 2 ** 30:.2f} GiB, less the block maxima)."]
    if base and EIGHT_BIT_FLAG in rows:
        eight = rows[EIGHT_BIT_FLAG]
        lines += ["", f"8-bit moments cost {eight['update_cpu_s'] - base:.1f} CPU s per update "
                      f"more than float32 ones ({against(eight, fp32, 'update_cpu_s'):.2f}x; the "
                      f"goal, issue 47: 1.15x at most), "
                      f"{eight['step_cpu_s'] - fp32['step_cpu_s']:.1f} s of it in the optimizer "
                      f"step; in wall time {against(eight, fp32, 'update_s'):.2f}x."]
    narrow = rows.get(SETTINGS["8bit-bf16-grads"][0])
    if narrow:
        lines += ["", f"With the optimizer step's memory settings ({SETTINGS['8bit-bf16-grads'][0]}"
                      f"): {max(narrow['peaks_gb']):.2f} GiB per rank at most, predicted "
                      f"{narrow['predicted_gb']:.2f} (the goal, issue 47: at most 4.0)."]
    lines += ["", "The estimator places each peak at "
              + "; ".join(f"{name}: {row['predicted_moment']}" for name, row in rows.items())
              + ".", "", END]
    return "\n".join(lines)


def main(args: argparse.Namespace, command_line: str) -> int:
    """Measure every setting (or reload them, --report-only), replace the section of --out, save
    the rows (benchmark_adam_stats_600m.json in --work)."""
    def measure(data: Path, work: Path) -> dict:
        chosen = {label: flags for name, (label, flags) in SETTINGS.items()
                  if name in args.settings}
        runs = {label: [] for label in chosen}
        for _ in range(args.rounds):  # in turn: neighbours in time share the machine's state
            for label, flags in chosen.items():
                runs[label].append(measure_setting(data, work, args, flags))
        return {"rows": {label: combined(r) for label, r in runs.items()},
                "meta": {"command": command_line, "date": time.strftime("%Y-%m-%d"),
                         "ranks": args.ranks, "max_tokens": args.max_tokens,
                         "updates": args.updates, "rounds": args.rounds}}

    saved = measured_or_saved(args, "benchmark_adam_stats_600m.json", measure)
    text = report(saved["rows"], versions(), saved["meta"])
    replace_section(Path(args.out), BEGIN, END, text)
    print(text)
    return 0
