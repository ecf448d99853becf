#!/usr/bin/env python
"""The vocabulary loss, side by side (not a test): fairseq's stock label_smoothed_cross_entropy
against the fused chunked loss at several --loss-chunk-tokens, on the NLLB-shaped reduced model
of scripts/benchmark.py (256,206-word vocabulary), FSDP2 per-layer, root reshard always, the
tied-gradient buffer (the recipe's settings), at 1 and 2 ranks, in one run.

Each row: per-rank peak, median words/s, the estimator's prediction, and the all-gathers of the
shared embedding in one update (torch.profiler, tests/probes/count_all_gathers.py, imported by
every rank). With --baseline-plugin DIR (a copy of an earlier fairseq_fsdp2, e.g.
``git archive main fairseq_fsdp2 | tar -x -C /tmp/old``) the earlier chunked loss (logits
recomputed in backward) runs too, at the same chunk sizes. The sweep and its report:
benchmarks/loss_sweep.py.

Replaces the section between the markers in docs/benchmarks.md.

  .venv/bin/python scripts/benchmark_loss.py --baseline-plugin /tmp/old/fairseq_fsdp2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import loss_sweep  # noqa: E402
from benchmarks.harness import ROOT, SEQ, command_of  # noqa: E402

#: The all-gather counter every rank imports (test code: tests/probes/).
PROBE = ROOT / "tests" / "probes" / "count_all_gathers.py"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/fairseq_fsdp2_benchmark")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--max-tokens", type=int, default=64 * SEQ)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline-chunks", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--baseline-plugin", default=None,
                        help="an earlier fairseq_fsdp2 directory: its chunked loss runs too")
    parser.add_argument("--timeout", type=float, default=1200)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return loss_sweep.main(args, command_of("scripts/benchmark_loss.py", argv), PROBE)


if __name__ == "__main__":
    sys.exit(main())
