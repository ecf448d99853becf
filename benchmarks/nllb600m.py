"""The real NLLB-600M dimensions on 2 CPU ranks with the fine-tuning recipe's memory settings
(not a test): `transformer_nllb_600m` (615.1M parameters, 256,206-word vocabulary), FSDP2
per-layer, `--fsdp2-root-reshard always`, the fused chunked loss at the recipe's chunk size, the
tied-gradient buffer, fp32, Adam, `--max-tokens 512` per rank.

Reports each rank's measured peak (the largest logged mem_peak_gb_max from update 2 on) next to
the estimator's prediction for the same command line and the analytic floor: the fp32 shards of
parameters, gradients and Adam's two moments (16 bytes x parameters / ranks), one gathered
copy of the shared embedding, one embedding-sized gradient, and the process's runtime baseline.
Replaces the section between the markers in docs/benchmarks.md. scripts/benchmark_nllb600m.py
parses the arguments (main's ``args``).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .harness import (NLLB_600M, SEQ, launch, measured_or_saved, parse_records, predicted,
                      replace_section, stop_if_a_rank_failed, train_args, versions)

BEGIN, END = "<!-- nllb-600m: begin -->", "<!-- nllb-600m: end -->"
RECIPE_CHUNK = 256  # scripts/finetune_nllb.sh's --loss-chunk-tokens default
GIB = 2 ** 30


def recipe(chunk: int) -> list[str]:
    return ["--ddp-backend", "fsdp2", "--min-params-to-wrap", "1", "--fsdp2-root-reshard",
            "always", "--criterion", "label_smoothed_cross_entropy_chunked",
            "--loss-chunk-tokens", str(chunk)]


def recipe_run_described(info: dict, meta: dict) -> str:
    """The start of a 600M benchmark section's description: its command and date, the machine,
    the model and the recipe's settings, through the updates run (the 8-bit moments' and
    LoRA's benchmarks go on from there)."""
    return (f"Command: `{meta['command']}` ({meta['date']}). Machine: {info['cores']} cores "
            f"({info['cpu']}), {info['memory_gib']} GiB; Python {info['python']}, torch "
            f"{info['torch']}, fairseq-fixed {info['fairseq']}; gloo. `transformer_nllb_600m` "
            f"(615.1M parameters, 256,206-word vocabulary), {meta['ranks']} ranks, the recipe's "
            f"memory settings (FSDP2 per-layer, `--fsdp2-root-reshard always`, the chunked loss "
            f"of {RECIPE_CHUNK} tokens, the tied-gradient buffer), `--bf16`, Adam, "
            f"`--max-tokens {meta['max_tokens']}` per rank, {meta['updates']} updates")


def floor_gb(model, world: int) -> dict:
    """The analytic floor per rank, by part (GiB)."""
    from fairseq_fsdp2.estimator.peak import cpu_baseline_bytes
    params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embed = model.encoder.embed_tokens.weight
    vocab = embed.size(0)
    parts = {"shards (params, grads, Adam m and v; fp32)": 16 * params / world,
             "gathered embedding": 4 * embed.numel(), "embedding gradient": 4 * embed.numel(),
             "runtime baseline": cpu_baseline_bytes(vocab)}
    parts = {k: v / GIB for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    parts["params"] = params
    return parts


def run(data: Path, work: Path, args) -> dict:
    """Predict, compute the floor, then train --updates updates on --ranks ranks: the row."""
    from fairseq_fsdp2.estimator import from_args
    train = train_args(data, NLLB_600M, recipe(args.chunk), args.max_tokens,
                       args.updates, work / "unused")
    prediction = predicted(train, args.ranks)
    model = from_args.build_meta_model(from_args.parse(train))
    row = {"ranks": args.ranks, "max_tokens": args.max_tokens, "chunk": args.chunk,
           "predicted_gb": round(prediction.peak_gb, 3),
           "predicted_moment": prediction.classes[0].moment,
           "predicted_breakdown": {k: round(v / GIB, 3)
                                   for k, v in prediction.classes[0].breakdown.items()},
           "floor": floor_gb(model, args.ranks), "load": os.getloadavg()[0]}
    del model
    t0 = time.time()
    results = launch(args.ranks, lambda rank: train, args.timeout)
    row["wall_s"] = round(time.time() - t0, 1)
    stop_if_a_rank_failed(results)
    records = [r for r in parse_records(results[0][1]) if int(r["num_updates"]) >= 2]
    row["peak_gb"] = max(float(r["mem_peak_gb_max"]) for r in records)
    row["peaks_gb"] = [float(r["mem_peak_gb_max"]) for r in records]
    row["seconds_per_update"] = [round(float(r["train_wall"]), 1) for r in records]
    return row


def report(row: dict, info: dict) -> str:
    """The section (markers included): measured, predicted, the floor and the goal."""
    f = row["floor"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in f.items() if k not in ("total", "params"))
    ratio = row["peak_gb"] / f["total"]
    goal = 1.07 * f["total"]
    lines = [
        BEGIN, "## Real NLLB-600M dimensions, 2 ranks, the recipe's memory settings", "",
        f"Command: `{row.get('command', '.venv/bin/python scripts/benchmark_nllb600m.py')}` "
        f"({row.get('date', 'date not recorded')}). "
        f"Machine: {info['cores']} cores ({info['cpu']}), "
        f"{info['memory_gib']} GiB; Python {info['python']}, torch {info['torch']}, "
        f"fairseq-fixed {info['fairseq']}; gloo, fp32, Adam; load average {row['load']:.1f} at "
        f"the start. `transformer_nllb_600m` with the 256,206-word vocabulary "
        f"({f['params'] / 1e6:.1f}M parameters), {row['ranks']} ranks, FSDP2 per-layer, "
        f"`--fsdp2-root-reshard always`, `--criterion label_smoothed_cross_entropy_chunked "
        f"--loss-chunk-tokens {row['chunk']}`, the tied-gradient buffer (what "
        f"`scripts/finetune_nllb.sh` runs), `--max-tokens {row['max_tokens']}` per rank "
        f"({row['max_tokens'] // SEQ} sentences of {SEQ} tokens). Measured: each "
        f"rank's peak resident memory per update (VmHWM, `mem_peak_gb_max`), the largest from "
        f"update 2 on; {row['wall_s']:.0f} s for the run, "
        f"{', '.join(map(str, row['seconds_per_update']))} s per measured update.", "",
        "| | per-rank peak GiB | vs floor |", "|---|---:|---:|",
        f"| measured | {row['peak_gb']:.2f} | {ratio:.3f}x |",
        f"| estimator (`python -m fairseq_fsdp2.estimate`, same flags, `--seq-len {SEQ}`)"
        f" | {row['predicted_gb']:.2f} | {row['predicted_gb'] / f['total']:.3f}x |",
        f"| analytic floor ({parts}) | {f['total']:.2f} | 1.000x |",
        f"| goal (1.07x the floor) | {goal:.2f} | 1.070x |", "",
        f"The goal is {'met' if row['peak_gb'] <= goal else 'NOT met'}. The estimator places "
        f"the peak at {row['predicted_moment']}; its breakdown there (GiB): "
        + ", ".join(f"{k} {v:.2f}" for k, v in row["predicted_breakdown"].items()) + ". "
        "The floor's parts are not all alive at one moment, but two moments come close to "
        "it: at the end of backward the shared unit's reduce-scatter holds its unsharded "
        "gradient (the floor's embedding gradient), FSDP2's reduce-scatter input (where the "
        "gathered embedding was) and output, and every other sharded gradient; during the "
        "loss's forward no sharded gradient exists yet, while the activations saved for "
        "backward and one chunk of logits (chunk tokens x 256,206 fp32) do.", "", END]
    return "\n".join(lines)


def main(args: argparse.Namespace, command: str) -> int:
    """Run (or, with --report-only, reload) the row, replace its section of --out, save the
    row (benchmark_nllb600m.json in --work); ``command`` is what the report records."""
    def measure(data: Path, work: Path) -> dict:
        return {**run(data, work, args), "command": command, "date": time.strftime("%Y-%m-%d")}

    row = measured_or_saved(args, "benchmark_nllb600m.json", measure)
    text = report(row, versions())
    replace_section(Path(args.out), BEGIN, END, text)
    print(text)
    return 0
