#!/usr/bin/env python
"""The real NLLB-600M dimensions on 2 CPU ranks with the fine-tuning recipe's memory settings
(not a test): `transformer_nllb_600m` (615.1M parameters, 256,206-word vocabulary), FSDP2
per-layer, `--fsdp2-root-reshard always`, the fused chunked loss at the recipe's chunk size, the
tied-gradient buffer, fp32, Adam, `--max-tokens 512` per rank.

Reports each rank's measured peak next to the estimator's prediction for the same command line
and the analytic floor (benchmarks/nllb600m.py says what it holds). (The GPU
predictions for the same model are tables of their own: scripts/predicted_tables.py.)

Replaces the section between the markers in docs/benchmarks.md.

  .venv/bin/python scripts/benchmark_nllb600m.py          # about 10 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import nllb600m  # noqa: E402
from benchmarks.harness import ROOT, command_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/fairseq_fsdp2_benchmark_600m")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=nllb600m.RECIPE_CHUNK)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=2400)
    parser.add_argument("--report-only", metavar="JSON", default=None,
                        help="rewrite the report from a saved benchmark_nllb600m.json")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return nllb600m.main(args, command_of("scripts/benchmark_nllb600m.py", argv))


if __name__ == "__main__":
    sys.exit(main())
