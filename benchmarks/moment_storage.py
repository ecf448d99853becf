"""How fast Adam's moments are stored in fewer bits, on one CPU thread (not a test): a
ROWS x COLS float32 tensor (4096 x 4096 by default: 16.8M elements, a layer of NLLB-3.3B's
FFN), in one process, interleaved rounds, medians:

- ``blockwise_8bit.quantize`` (signed map: the first moment; unsigned: the second) and
  ``dequantize``, ``stochastic_round.to_bf16_stochastic``, and fairseq's float32 Adam update of
  the same tensor for scale;
- the plugin's whole optimizer step of that one parameter (optimizer/build.py: fairseq's Adam,
  moments widened, stepped and stored again) with float32, fp16, bf16 and 8-bit moments, and
  each against float32 moments.

``MALLOC_MMAP_THRESHOLD_=65536`` as the training scripts set it (each new temporary then costs
page faults, as in training). Replaces the section between the markers in docs/benchmarks.md;
scripts/benchmark_moment_storage.py parses the arguments.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from fairseq.optim.adam import FairseqAdamConfig
from omegaconf import OmegaConf

from fairseq_fsdp2.optimizer.moments import kernels
from fairseq_fsdp2.optimizer.moments.blockwise_8bit import dequantize, quantize
from fairseq_fsdp2.optimizer.build import build_optimizer
from fairseq_fsdp2.optimizer.moments.stochastic_round import to_bf16_stochastic
from .harness import replace_section, versions

BEGIN, END = "<!-- moment-storage: begin -->", "<!-- moment-storage: end -->"
SETTINGS = ("fp32", "fp16", "bf16", "8bit")


def plugin_adam(param: torch.nn.Parameter, stats: str) -> torch.optim.Optimizer:
    adam = OmegaConf.structured(FairseqAdamConfig(_name="adam", lr=[1e-3], tpu=False,
                                                  fp16_adam_stats=stats == "fp16"))
    cfg = OmegaConf.create({"common": {"fp16": False, "seed": 1}, "optimizer": adam,
                            "distributed_training": {"bf16_adam_stats": stats == "bf16",
                                                     "eight_bit_adam_stats": stats == "8bit"}})
    return build_optimizer(cfg, [param]).optimizer


def measure(rows: int, cols: int, rounds: int) -> dict:
    """Median seconds of each operation over ``rounds`` interleaved rounds (a first, untimed
    round creates the moments and warms up)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g)
    v = x * x
    scratch = torch.empty_like(x)
    bf16 = torch.empty(x.shape, dtype=torch.bfloat16)
    codes, absmax = quantize(x, True, g)
    codes_v, absmax_v = quantize(v, False, g)
    params = {s: torch.nn.Parameter(x.clone()) for s in SETTINGS}
    for p in params.values():
        p.grad = torch.randn(x.shape, generator=g) * 1e-2
    steppers = {f"optimizer step, {s} moments": plugin_adam(p, s).step
                for s, p in params.items()}
    ops = {
        "quantize (signed map: first moment)": lambda: quantize(x, True, g, codes, absmax),
        "quantize (unsigned map: second moment)": lambda: quantize(v, False, g, codes_v,
                                                                   absmax_v),
        "dequantize": lambda: dequantize(codes, absmax, True, out=scratch),
        # the eager tensor operations (the reference, and where no C++ kernel is built)
        "quantize, eager (signed map)": lambda: quantize(x, True, g, codes, absmax,
                                                         kernel=False),
        "dequantize, eager": lambda: dequantize(codes, absmax, True, out=scratch,
                                                kernel=False),
        "bf16 stochastic rounding": lambda: to_bf16_stochastic(scratch.copy_(x), g, out=bf16),
        **steppers}
    if kernels.best_loops() != kernels.PLAIN:  # the kernel's plain loops, where vector ones run
        ops["quantize, plain C++ loops (signed map)"] = lambda: quantize(
            x, True, g, codes, absmax, isa=kernels.PLAIN)
    times: dict = {name: [] for name in ops}
    for round_ in range(rounds + 1):
        for name, op in ops.items():
            t0 = time.perf_counter()
            op()
            if round_:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def report(seconds: dict, info: dict, meta: dict) -> str:
    fp32 = seconds["optimizer step, fp32 moments"]
    lines = [BEGIN, "## Storing Adam's moments in 16 and 8 bits: one thread", "",
             f"Command: `{meta['command']}` ({meta['date']}). Machine: {info['cpu']}; Python "
             f"{info['python']}, torch {info['torch']}, fairseq-fixed {info['fairseq']}; one "
             f"thread, `MALLOC_MMAP_THRESHOLD_=65536`, load average {meta['load']:.1f}. A "
             f"{meta['rows']} x {meta['cols']} float32 tensor; medians of {meta['rounds']} "
             f"interleaved rounds. The optimizer step: the plugin's Adam "
             f"(`optimizer/build.py`) over that one parameter, moments widened, stepped and "
             f"stored again (`optimizer/adam_stats.py`). 8-bit rows: "
             + (f"the C++ kernel (`optimizer/kernels.py`; its {meta.get('loops', 'plain')} "
                f"loops, the best this CPU runs), unless marked eager (the tensor operations it "
                f"replaces) or plain (its loops for any CPU)." if meta.get("kernel") else
                "no C++ kernel was built: every row is the eager tensor operations."), "",
             "| operation | seconds | against the step with float32 moments |", "|---|---:|---:|"]
    lines += [f"| {name} | {s:.4f} | {s / fp32:.2f}x |" for name, s in seconds.items()]
    return "\n".join(lines + ["", END])


def main(args: argparse.Namespace, command_line: str) -> int:
    seconds = measure(args.rows, args.cols, args.rounds)
    meta = {"command": command_line, "date": time.strftime("%Y-%m-%d"), "rows": args.rows,
            "kernel": kernels.blockwise_8bit() is not None,
            "loops": kernels.LOOP_NAMES[kernels.best_loops()],
            "cols": args.cols, "rounds": args.rounds, "load": os.getloadavg()[0]}
    text = report(seconds, versions(), meta)
    replace_section(Path(args.out), BEGIN, END, text)
    print(text)
    return 0
