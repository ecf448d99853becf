#!/usr/bin/env python
"""LoRA (--lora-rank 16) against full fine-tuning (--eight-bit-adam-stats) at the real NLLB-600M
dimensions on 2 CPU ranks (not a test): each rank's peak resident memory from outside the
process (GNU time) beside the estimator's prediction, and words per second
(benchmarks/lora_600m.py says what it runs).

Replaces the section between the markers in docs/benchmarks.md.

  .venv/bin/python scripts/benchmark_lora_600m.py     # about 10 minutes on 2 cores
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_adam_stats_600m import build_parser  # noqa: E402  (the same arguments)
from benchmarks import lora_600m  # noqa: E402
from benchmarks.harness import command_of  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(work="/tmp/fairseq_fsdp2_benchmark_lora")
    args = parser.parse_args(argv)
    return lora_600m.main(args, command_of("scripts/benchmark_lora_600m.py", argv))


if __name__ == "__main__":
    sys.exit(main())
