#!/usr/bin/env python
"""Synchronous vs asynchronous checkpoints, side by side in one run (not a test): the same
2-rank FSDP2 training, saving every few updates, once without and once with
`--write-checkpoints-asynchronously`. What it measures: benchmarks/async_save_run.py.
Replaces the section between the markers in docs/benchmarks.md.

  .venv/bin/python scripts/benchmark_async_save.py      # about 5 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import async_save_run  # noqa: E402
from benchmarks.harness import ROOT, command_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Synchronous vs asynchronous checkpoints, "
                                     "side by side in one run")
    parser.add_argument("--work", default="/tmp/fairseq_fsdp2_benchmark_async")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--report-only", metavar="JSON", default=None,
                        help="rewrite the report from a saved benchmark_async_save.json")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return async_save_run.main(args, command_of("scripts/benchmark_async_save.py", argv))


if __name__ == "__main__":
    sys.exit(main())
