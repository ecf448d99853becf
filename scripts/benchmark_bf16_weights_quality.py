#!/usr/bin/env python
"""Fine-tuning quality of bf16 weights without an fp32 master (--memory-efficient-bf16,
stochastic rounding) against fp32 master weights and bf16 weights rounded to nearest, on 2 CPU
ranks (not a test): the demo's tiny model pretrained, then fine-tuned at a fine-tuning learning
rate in each setting; fairseq's validation loss and chrF++ per direction
(benchmarks/bf16_weights_quality.py says what it runs). Replaces the section between the
markers in docs/benchmarks.md.

  nice -n 10 .venv/bin/python scripts/benchmark_bf16_weights_quality.py  # ~20 min on 2 cores
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bf16_weights_quality  # noqa: E402
from benchmarks.harness import ROOT, command_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/fairseq_fsdp2_benchmark_bf16_quality",
                        help="corpus, checkpoints, logs, evaluations and the saved results")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--pretrain-updates", type=int, default=200,
                        help="the pretrained model's updates (the demo's 200)")
    parser.add_argument("--updates", type=int, default=150, help="fine-tuning updates")
    parser.add_argument("--lr", default="1e-4", help="the fine-tuning learning rate")
    parser.add_argument("--validate-every", type=int, default=25,
                        help="updates between validations (--validate-interval-updates)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--report-only", metavar="JSON",
                        help="write the report from an earlier run's saved results "
                             "(WORK/bf16_weights_quality.json)")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.pretrain_updates, args.updates, args.validate_every) < 1:
        parser.error("--pretrain-updates, --updates and --validate-every must be at least 1")
    if args.updates % args.validate_every:
        parser.error("--updates must be a multiple of --validate-every (the last validation "
                     "is the table's)")
    return bf16_weights_quality.main(
        args, command_of("scripts/benchmark_bf16_weights_quality.py", argv))


if __name__ == "__main__":
    sys.exit(main())
