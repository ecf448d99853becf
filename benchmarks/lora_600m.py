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
import re
import time
from pathlib import Path

from .adam_stats_600m import COMMON
from .harness import (NLLB_600M, SEQ, TIME, launch, measured_or_saved, peaks_gb, predicted,
                      replace_section, stop_if_a_rank_failed, train_args, versions)
from .nllb600m import RECIPE_CHUNK, recipe, recipe_run_described

WPS = re.compile(r'"train_wps": "([0-9.]+)"')
BEGIN, END = "<!-- lora-600m: begin -->", "<!-- lora-600m: end -->"
LORA = ["--lora-rank", "16", "--lora-alpha", "32"]
EIGHT_BIT = ["--eight-bit-adam-stats"]
#: stands for the base checkpoint's path in a setting's flags
BASE = "{base}"
FINETUNE = ["--finetune-from-model", BASE]
#: each setting's flags on top of the common command line. From a random initialisation every
#: rank builds the full fp32 model first (fairseq's build); from a checkpoint
#: (--finetune-from-model, a bf16 stock checkpoint written first) the model is built on the
#: meta device and each rank allocates only its shards, as a LoRA run fine-tunes
SETTINGS = {"LoRA, " + " ".join(LORA) + ", random init": LORA,
            "full fine-tuning, --eight-bit-adam-stats, random init": EIGHT_BIT,
            "LoRA, " + " ".join(LORA) + ", from a bf16 checkpoint": LORA + FINETUNE,
            "full fine-tuning, --eight-bit-adam-stats, from a bf16 checkpoint":
                EIGHT_BIT + FINETUNE,
            # the recipe's --speed: the shared embedding gathered once per step, not again
            # for the loss (no second gathered copy beside the activations)
            "LoRA, " + " ".join(LORA) + ", from a bf16 checkpoint, --fsdp2-root-reshard "
            "default": LORA + FINETUNE + ["--fsdp2-root-reshard", "default"]}


def write_base(data: Path, work: Path, args) -> Path:
    """A stock fairseq checkpoint of the randomly initialised model in bf16 (as the NLLB
    checkpoints a LoRA run starts from are read: weights only), written once in --work."""
    out = work / "base_bf16.pt"
    if out.exists():
        return out
    import torch
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    train = command(data, work, args, [])
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), train[:]))
    torch.manual_seed(1)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    state, cast = {}, {}
    for k, v in model.state_dict().items():  # a tied weight cast once (one tensor, 3 names)
        state[k] = cast.setdefault(v.data_ptr(), v.to(torch.bfloat16)) \
            if v.is_floating_point() else v
    del model
    torch.save({"model": state}, str(out) + ".tmp")
    os.replace(str(out) + ".tmp", out)
    return out


def command(data: Path, work: Path, args, flags: list[str]) -> list[str]:
    return train_args(data, NLLB_600M, recipe(RECIPE_CHUNK) + COMMON + flags, args.max_tokens,
                      args.updates, work / "unused")


def measure_setting(data: Path, work: Path, args, flags: list[str]) -> dict:
    if BASE in flags:
        base = str(write_base(data, work, args))
        flags = [base if f == BASE else f for f in flags]
    t0 = time.time()
    results = launch(args.ranks, lambda rank: command(data, work, args, flags), args.timeout,
                     wrapper=TIME)
    stop_if_a_rank_failed(results)
    peaks = peaks_gb(results)
    wps = WPS.findall(results[0][1])  # fairseq's end-of-epoch record (both updates)
    return {"flags": flags, "peaks_gb": peaks, "wall_s": round(time.time() - t0, 1),
            "wps": float(wps[-1]) if wps else None, "load": os.getloadavg()[0],
            "summary": [line for line in results[0][1].splitlines() if "train_wps" in line]}


def report(rows: dict, info: dict, meta: dict, work: Path, args) -> str:
    lines = [
        BEGIN, "## LoRA against full fine-tuning: real NLLB-600M dimensions, 2 ranks", "",
        recipe_run_described(info, meta) + " from a random "
        f"initialisation or from a bf16 stock checkpoint of it (`--finetune-from-model`), "
        f"`--log-interval 1000`, the settings run one after the other in one run (the load "
        f"average beside each: other work shared the machine). Peak: GNU time's maximum resident set of each rank's process "
        f"(`/usr/bin/time -f %M`). Predicted: `python -m fairseq_fsdp2.estimate` with the same "
        f"command line, `--world-size {meta['ranks']} --seq-len {SEQ}`. Words per second: "
        f"fairseq's end-of-epoch `train_wps` (both updates).", "",
        "| setting | rank 0 GiB | rank 1 GiB | predicted GiB | words/s | wall s | load |",
        "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        cells = " | ".join(f"{p:.2f}" for p in row["peaks_gb"])
        try:
            flags = row["flags"]  # the estimator reads no weights: without the checkpoint
            if FINETUNE[0] in flags:
                at = flags.index(FINETUNE[0])
                flags = flags[:at] + flags[at + 2:]
            guess = f"{predicted(command(Path(meta['data']), work, args, flags), meta['ranks']).peak_gb:.2f}"
        except Exception as e:  # noqa: BLE001 - shown in the table, not hidden
            guess = f"({type(e).__name__})"
        wps = f"{row['wps']:.0f}" if row.get("wps") else "-"
        lines.append(f"| {name} | {cells} | {guess} | {wps} | {row['wall_s']:.0f} | "
                     f"{row['load']:.1f} |")
    lora = [r for n, r in rows.items() if n.startswith("LoRA")]
    full = [r for n, r in rows.items() if n.startswith("full")]
    if lora and full and all(r.get("wps") for r in lora + full):
        ratios = ", ".join(f"{a['wps'] / b['wps']:.1f}x" for a, b in zip(lora, full))
        lines += ["", f"LoRA against full fine-tuning, words per second: {ratios} (random "
                      f"init, from a checkpoint)."]
    lines += ["", "The estimator predicts the training step (update 2 on); from a random "
              "initialisation every rank first builds the whole fp32 model (fairseq's build: "
              "615.1M x 4 bytes = 2.29 GiB) before it is sharded, which sets the LoRA run's "
              "peak there; from a checkpoint the model is built on the meta device and each "
              "rank allocates only its shards, while rank 0 reads the checkpoint "
              "memory-mapped (its pages count in rank 0's resident set as they are read).",
              "", END]
    return "\n".join(lines)


def main(args: argparse.Namespace, command_line: str) -> int:
    """Measure both settings (or reload them, --report-only), replace the section of --out,
    save the rows (benchmark_lora_600m.json in --work)."""
    def measure(data: Path, work: Path) -> dict:
        # rows an interrupted run saved are kept (each setting takes minutes)
        partial = work / "benchmark_lora_600m.partial.json"
        rows = json.loads(partial.read_text()) if partial.exists() else {}
        for name, flags in SETTINGS.items():
            if name not in rows:
                rows[name] = measure_setting(data, work, args, flags)
                partial.write_text(json.dumps(rows, indent=1))
        return {"rows": rows, "meta": {"command": command_line, "date": time.strftime("%Y-%m-%d"),
                                       "ranks": args.ranks, "max_tokens": args.max_tokens,
                                       "updates": args.updates, "data": str(data)}}

    saved = measured_or_saved(args, "benchmark_lora_600m.json", measure)
    text = report(saved["rows"], versions(), saved["meta"], Path(args.work), args)
    replace_section(Path(args.out), BEGIN, END, text)
    print(text)
    return 0
