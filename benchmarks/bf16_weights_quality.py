"""bf16 weights without an fp32 master copy (``--memory-efficient-bf16``): fine-tuning quality
against fp32 master weights and against bf16 weights rounded to nearest, on 2 CPU ranks (not a
test).

The demo's corpus and model (scripts/demo.sh: numbers in words, eng_Latn-fra_Latn and
eng_Latn-deu_Latn, SentencePiece 300, ``transformer_nllb_tiny``), every run's command line the
fine-tuning recipe's (recipes/finetune_nllb.py ``--dry-run``: NLLB's Adam, inverse_sqrt, the
chunked loss; the demo's ``--max-tokens 4000 --seed 1 --clip-norm 1.0``), run by the benchmark
worker (harness.launch):

1. the pretrained model: the demo's training (lr 4e-3, 30 warm-up updates) with
   ``--memory-efficient-bf16``, so that its weights are bf16 values and every fine-tuning run
   below starts from the very same weights (a bf16 value is a float32 value);
2. fine-tuned from it (``--pretrained``: weights only) at a fine-tuning learning rate, each
   setting on the same data, seed and batches, all computing in bf16: ``--bf16`` (float32
   master weights), ``--memory-efficient-bf16`` (bf16 weights, stochastic rounding), the same
   with other rounding draws (the twin: the rounding's own noise), and the same rounded to
   nearest (weight_rounding.py: the plugin's test-only switch, so that the control differs from
   ours in the write-back's rounding alone);
3. fairseq's validation loss every ``--validate-every`` updates, and chrF++ per direction of
   each run's last checkpoint (and of the pretrained model) on the test split by
   ``python -m fairseq_fsdp2.evaluate`` (NLLB's generation settings, float32 on the CPU).

Replaces the section between the markers in docs/benchmarks.md;
scripts/benchmark_bf16_weights_quality.py parses the arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .harness import ROOT, launch, replace_section, stop_if_a_rank_failed, versions
from .weight_rounding import VARIABLE

BEGIN = "<!-- bf16-weights-quality: begin -->"
END = "<!-- bf16-weights-quality: end -->"
PAIRS = "eng_Latn-fra_Latn,eng_Latn-deu_Latn"
#: the demo's training settings (scripts/demo_lib.sh, scripts/demo.sh)
DEMO = ["--model-size", "tiny", "--cpu", "--nproc", "2", "--max-tokens", "4000",
        "--root-reshard", "always", "--seed", "1", "--precision", "fp32"]
DEMO_EXTRA = ["--clip-norm", "1.0", "--no-epoch-checkpoints", "--save-interval", "100000",
              "--log-format", "json"]
#: name -> (fairseq-train flags, BENCHMARK_WEIGHT_ROUNDING)
SETTINGS = {
    "fp32 master weights (--bf16)": (["--bf16"], ""),
    "bf16 weights, stochastic rounding (--memory-efficient-bf16)":
        (["--memory-efficient-bf16"], ""),
    "the same, other rounding draws (twin)": (["--memory-efficient-bf16"], "other-draws"),
    "bf16 weights, rounded to nearest (control)": (["--memory-efficient-bf16"], "nearest"),
}
MASTER, OURS, TWIN, NEAREST = SETTINGS
#: fairseq's validation record (--log-format json), in its log format or the root logger's
#: (the worker configures logging before fairseq-train does)
VALID = re.compile(r"(?:\| |:)valid(?: \| |:)(\{.*\})")


def recipe_args(options: list[str], extra: list[str]) -> list[str]:
    """fairseq-train's arguments as the recipe makes them (its --dry-run's command)."""
    line = subprocess.run([sys.executable, str(ROOT / "recipes" / "finetune_nllb.py"),
                           "--dry-run", *DEMO, *options, "--", *DEMO_EXTRA, *extra],
                          check=True, capture_output=True, text=True).stdout
    words = shlex.split(line)
    return words[[i for i, w in enumerate(words) if w.endswith("fairseq-train")][0] + 1:]


def train(name: str, args: list[str], rounding: str, work: Path, timeout: float) -> dict:
    """One run on 2 ranks; rank 0's output in WORK/logs/; its validation losses and time."""
    os.environ[VARIABLE] = rounding
    t0 = time.time()
    try:
        results = launch(2, lambda rank: args, timeout, preload=["benchmarks.weight_rounding"])
    finally:
        os.environ.pop(VARIABLE)
    (work / "logs").mkdir(exist_ok=True)
    (work / "logs" / f"{re.sub(r'[^a-z0-9]+', '_', name.lower())}.log").write_text(results[0][1])
    stop_if_a_rank_failed(results, name)
    valid = {int(float(r["valid_num_updates"])): float(r["valid_loss"])
             for r in map(json.loads, VALID.findall(results[0][1]))}
    return {"wall_s": round(time.time() - t0), "valid_loss": valid}


def evaluate(data: Path, checkpoint: Path, out: Path) -> dict:
    """chrF++ per direction: python -m fairseq_fsdp2.evaluate on the test split."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get(
                   "PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, "-m", "fairseq_fsdp2.evaluate", str(data),
                           str(checkpoint), "--out", str(out), "--no-progress"],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"evaluation of {checkpoint} exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    directions = json.loads((out / "results.json").read_text())["directions"]
    return {d: round(v["scores"]["model"]["chrf++"], 2) for d, v in directions.items()}


def fresh(path: Path) -> Path:
    """A run's save directory, emptied: a checkpoint left by an earlier benchmark would be
    resumed (fairseq restores SAVE_DIR/checkpoint_last.pt)."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def measure(args: argparse.Namespace, work: Path) -> dict:
    raw, data = work / "raw", work / "data"
    if not (data / "lang_pairs.txt").exists():
        prepare = ["bash", str(ROOT / "scripts" / "prepare_data.sh")]
        subprocess.run([*prepare, "--numbers", str(raw), "--lang-pairs", PAIRS, "--n-train",
                        "4000", "--n-valid", "200", "--n-test", "200"], check=True,
                       capture_output=True)
        subprocess.run([*prepare, str(raw), str(data), "--vocab-size", "300"], check=True,
                       capture_output=True)
    saved: dict = {"load": [], "runs": {}}
    pretrained = fresh(work / "pretrained")
    run = train("pretrained", recipe_args(
        ["--data", str(data), "--save-dir", str(pretrained), "--max-update",
         str(args.pretrain_updates), "--lr", "4e-3", "--warmup-updates", "30",
         "--log-interval", "100"], ["--memory-efficient-bf16", "--disable-validation"]),
        "", work, args.timeout)
    start = pretrained / "checkpoint_last_consolidated.pt"
    run["chrf"] = evaluate(data, start, work / "evaluation" / "pretrained")
    # the start's validation loss, by the same validation: one update at lr 1e-7 (fp32 masters)
    run["valid_loss"] = train("start", recipe_args(
        ["--data", str(data), "--save-dir", str(fresh(work / "start")), "--pretrained", str(start),
         "--max-update", "1", "--lr", "1e-7", "--log-interval", "100"], ["--bf16"]),
        "", work, args.timeout)["valid_loss"]
    saved["runs"]["pretrained"] = run
    saved["load"].append(round(os.getloadavg()[0], 1))
    for i, (name, (flags, rounding)) in enumerate(SETTINGS.items()):
        save_dir = fresh(work / f"fine_tuned{i}")
        run = train(name, recipe_args(
            ["--data", str(data), "--save-dir", str(save_dir), "--pretrained", str(start),
             "--max-update", str(args.updates), "--lr", args.lr, "--log-interval", "100"],
            [*flags, "--validate-interval", "100000", "--validate-interval-updates",
             str(args.validate_every)]), rounding, work, args.timeout)
        run["chrf"] = evaluate(data, save_dir / "checkpoint_last_consolidated.pt",
                               work / "evaluation" / f"fine_tuned{i}")
        saved["runs"][name] = run
        saved["load"].append(round(os.getloadavg()[0], 1))
        print(f"{name}: {json.dumps(run)}", flush=True)
    return saved


def report(saved: dict, info: dict, meta: dict) -> str:
    runs = saved["runs"]
    directions = sorted(runs["pretrained"]["chrf"])
    last = max(runs[MASTER]["valid_loss"])
    start = runs["pretrained"]["valid_loss"].get(1)
    lines = [
        BEGIN, "## bf16 weights without an fp32 master: fine-tuning quality (tiny model, CPU)",
        "", f"Command: `{meta['command']}` ({meta['date']}; `nice -n 10`). Machine: "
        f"{info['cores']} cores ({info['cpu']}), {info['memory_gib']} GiB, shared with other "
        f"work (load average {', '.join(map(str, saved['load']))} at the runs' ends); Python "
        f"{info['python']}, torch {info['torch']}, fairseq-fixed {info['fairseq']}; 2 ranks, "
        f"gloo, FSDP2 per-layer. The demo's corpus and model (numbers in words, "
        f"{PAIRS.replace(',', ' and ')}, 4000 "
        f"training pairs each, 200 valid and 200 test; `transformer_nllb_tiny`), each command "
        f"line the recipe's (`recipes/finetune_nllb.py`, the demo's `--max-tokens 4000 --seed "
        f"1 --clip-norm 1.0`). Pretrained: {meta['pretrain_updates']} updates at lr 4e-3 with "
        f"`--memory-efficient-bf16`, so that every run below starts from the same weights "
        f"(bf16 values). Fine-tuned from it (`--pretrained`): {meta['updates']} updates at lr "
        f"{meta['lr']} (inverse_sqrt, warm-up {max(1, meta['updates'] // 10)} updates from "
        f"1e-7), the same seed and batches, bf16 compute in every run. The twin: our run with "
        f"other rounding draws (its distance from ours is the rounding's own noise, one "
        f"draw). The control: our run with the write-back rounded to nearest (the plugin's "
        f"test-only `RowChunkSteps.round_weights_to_nearest`, as stock fairseq's "
        f"`--memory-efficient-bf16` rounds, with nothing else changed). Validation loss: "
        f"fairseq's (label-smoothed, base 2, printed to 3 decimals) at update {last}, the "
        f"start's after one update at "
        f"lr 1e-7 (fp32 masters); chrF++: `python -m "
        f"fairseq_fsdp2.evaluate` of the last checkpoint on the test split (beam 4, float32).",
        "", "| run | valid loss | " + " | ".join(f"chrF++ {d}" for d in directions)
        + " | wall s |", "|---|---:|" + "---:|" * len(directions) + "---:|"]
    for name, run in runs.items():
        loss = start if name == "pretrained" else run["valid_loss"].get(last)
        label = f"pretrained ({meta['pretrain_updates']} updates, the start)" \
            if name == "pretrained" else name
        lines.append(f"| {label} | {'-' if loss is None else f'{loss:.3f}'} | "
                     + " | ".join(f"{run['chrf'][d]:.2f}" for d in directions)
                     + f" | {run['wall_s']} |")
    updates = sorted(runs[MASTER]["valid_loss"])
    lines += ["", "Validation loss during fine-tuning:", "",
              "| update | " + " | ".join(SETTINGS) + " |", "|---:|" + "---:|" * len(SETTINGS)]
    if start is not None:
        lines.append(f"| start | " + " | ".join(f"{start:.3f}" for _ in SETTINGS) + " |")
    lines += [f"| {n} | " + " | ".join(f"{runs[s]['valid_loss'].get(n, float('nan')):.3f}"
                                      for s in SETTINGS) + " |" for n in updates]
    lines += ["", differences(runs, directions, last), "", END]
    return "\n".join(lines)


def differences(runs: dict, directions: list[str], last: int) -> str:
    """Each run against the fp32-master run at update ``last``: the validation loss it gained
    from the start (and its share of the masters' gain), its distance from the masters' loss
    and chrF++; and the twin against ours (one draw of the rounding's own noise)."""
    start = runs["pretrained"]["valid_loss"].get(1)
    master = runs[MASTER]["valid_loss"][last]
    lines = ["Against the fp32 masters at update " + str(last) + ":", "",
             "| run | valid loss gained from the start | share of the masters' gain | valid "
             "loss minus the masters' | " + " | ".join(f"chrF++ {d} minus the masters'"
                                                     for d in directions) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(directions)]
    if start is not None:
        lines.append(f"| {MASTER} | {start - master:.3f} | 100% | - | "
                     + " | ".join("-" for _ in directions) + " |")
    for name in (OURS, TWIN, NEAREST):
        loss = runs[name]["valid_loss"][last]
        gained = "-" if start is None else f"{start - loss:.3f}"
        share = "-" if start is None or start == master else \
            f"{(start - loss) / (start - master):.0%}"
        lines.append(f"| {name} | {gained} | {share} | {loss - master:+.3f} | " + " | ".join(
            f"{runs[name]['chrf'][d] - runs[MASTER]['chrf'][d]:+.2f}" for d in directions)
            + " |")
    twin = runs[TWIN]["valid_loss"][last] - runs[OURS]["valid_loss"][last]
    lines += ["", f"The twin against ours (one draw of the rounding's own noise): valid loss "
              f"{twin:+.3f}, chrF++ " + ", ".join(
                  f"{runs[TWIN]['chrf'][d] - runs[OURS]['chrf'][d]:+.2f} ({d})"
                  for d in directions) + "."]
    return "\n".join(lines)


def main(args: argparse.Namespace, command_line: str) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads(Path(args.report_only).read_text())
        for run in saved["runs"].values():  # JSON's keys are strings
            run["valid_loss"] = {int(n): loss for n, loss in run["valid_loss"].items()}
    else:
        saved = measure(args, work)
        saved["meta"] = {"command": command_line, "date": time.strftime("%Y-%m-%d"),
                         "pretrain_updates": args.pretrain_updates, "updates": args.updates,
                         "lr": args.lr}
        (work / "bf16_weights_quality.json").write_text(json.dumps(saved, indent=1))
    text = report(saved, versions(), saved["meta"])
    replace_section(Path(args.out), BEGIN, END, text)
    print(text)
    return 0
