#!/usr/bin/env python
"""Adam's moments in fp32, bf16 (--bf16-adam-stats) and 8 bits (--eight-bit-adam-stats) at the
real NLLB-600M dimensions on 2 CPU ranks (not a test): each rank's peak resident memory from
outside the process (GNU time) beside the estimator's prediction, and the seconds per update and
of the optimizer step (benchmarks/adam_stats_600m.py says what it runs).

Replaces the section between the markers in docs/benchmarks.md.

  .venv/bin/python scripts/benchmark_adam_stats_600m.py     # about 25 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import adam_stats_600m  # noqa: E402
from benchmarks.harness import ROOT, command_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/fairseq_fsdp2_benchmark_adam_stats")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--updates", type=int, default=4,
                        help="updates per setting (at least 2: the first is not timed)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--settings", nargs="+", default=list(adam_stats_600m.SETTINGS),
                        choices=list(adam_stats_600m.SETTINGS),
                        help="the settings measured (default: all); the CPU-time ratios are "
                        "against fp32's when it is among them")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the settings in turn this many times: medians over the "
                        "rounds, ratios against fp32 within a round (one run per setting "
                        "moves with the machine's load)")
    parser.add_argument("--report-only", metavar="JSON", default=None,
                        help="rewrite the report from a saved benchmark_adam_stats_600m.json")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.updates < 2 and not args.report_only:
        parser.error("--updates must be at least 2: the first update is not timed")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return adam_stats_600m.main(args, command_of("scripts/benchmark_adam_stats_600m.py", argv))


if __name__ == "__main__":
    sys.exit(main())
