"""(not a test; `.venv/bin/python scripts/benchmark_optimizer_step.py [--tensors N] [--elements N]
[--steps N] [--adam-stats {fp16,bf16,8bit}]`) The CPU time of the optimizer's part of an update on
FSDP2 parameters, DTensor dispatch against the local shards (and, with --adam-stats, 16-bit or
8-bit Adam moments). What it measures and why: benchmarks/optimizer_step.py.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import optimizer_step  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="The CPU time of the optimizer's part of an "
                                     "update on FSDP2 parameters, DTensor dispatch vs local shards")
    parser.add_argument("--tensors", type=int, default=optimizer_step.NLLB_600M_TENSORS,
                        help="parameter tensors (default: NLLB-600M's 509)")
    parser.add_argument("--elements", type=int, default=64, help="elements per tensor")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (first dropped)")
    parser.add_argument("--adam-stats", choices=("fp16", "bf16", "8bit"), default=None,
                        help="also time the local shards with Adam's moments in 16 bits, or in "
                             "8 bits (weights of --elements 4096 or more; smaller ones keep "
                             "float32 moments)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    optimizer_step.main(args.tensors, args.elements, args.steps, args.adam_stats)


if __name__ == "__main__":
    main()
