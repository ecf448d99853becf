#!/usr/bin/env python
"""Side-by-side memory and speed benchmark (not a test): fairseq's stock legacy_ddp against the
FSDP2 backend, on the same data and batch, at 1, 2 and 4 ranks on this machine (CPU, gloo).

The configurations, what is measured and the report: benchmarks/plans.py.
Writes docs/benchmarks.md (tables, machine, versions) and docs/benchmark_memory.png.

  .venv/bin/python scripts/benchmark.py                 # the NLLB-shaped reduced model, 1/2/4 ranks
  .venv/bin/python scripts/benchmark.py --nllb-600m     # plus real NLLB-600M dims where it fits
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import plans  # noqa: E402
from benchmarks.harness import ROOT, SEQ, command_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/fairseq_fsdp2_benchmark",
                        help="corpus and scratch directory")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--png", default=str(ROOT / "docs" / "benchmark_memory.png"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-tokens", type=int, default=32 * SEQ)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--configs", nargs="+", default=list(plans.CONFIGS),
                        choices=list(plans.CONFIGS))
    parser.add_argument("--nllb-600m", action="store_true",
                        help="also run the real NLLB-600M dimensions where they fit")
    parser.add_argument("--big-max-tokens", type=int, default=8 * SEQ)
    parser.add_argument("--big-updates", type=int, default=3)
    parser.add_argument("--big-ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--report-only", metavar="BENCHMARK_JSON", default=None,
                        help="rewrite the report and chart from a saved benchmark.json")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return plans.main(args, command_of("scripts/benchmark.py", argv))


if __name__ == "__main__":
    sys.exit(main())
