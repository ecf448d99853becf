#!/usr/bin/env python
"""How fast Adam's moments are stored in 16 and 8 bits, one CPU thread (not a test): quantize,
dequantize, bf16 stochastic rounding and the plugin's whole optimizer step per moment format
(benchmarks/moment_storage.py says what it runs). Replaces the section between
the markers in docs/benchmarks.md.

  MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python scripts/benchmark_moment_storage.py  # ~1 min
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import moment_storage  # noqa: E402
from benchmarks.harness import ROOT, command_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (medians)")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.rows, args.cols, args.rounds) < 1:
        parser.error("--rows, --cols and --rounds must be at least 1")
    return moment_storage.main(args, command_of("scripts/benchmark_moment_storage.py", argv))


if __name__ == "__main__":
    sys.exit(main())
