"""``python -m fairseq_fsdp2.estimate``: predicted per-rank peak memory of a fairseq-train run.

Takes fairseq-train's own arguments (parsed by fairseq's parser, with this plugin's options) plus

  --world-size N [N ...]   ranks (default: --distributed-world-size); several give one row each
  --replicate-degree R     HSDP replicas (default: --fsdp2-replicate-degree)
  --device {cpu,cuda}      what "peak" means: CPU resident memory (adds the runtime baseline) or
                           CUDA allocator peak (default: cpu with --cpu, else cuda)
  --seq-len L              tokens per sentence, source and target (default 128)
  --vocab-size V           build the dictionary with V entries instead of reading DATA's
  --cpu-baseline-gb X      CPU runtime baseline (default: the value measured on this machine)

and prints the predicted peak of each class of ranks (ranks with equal shard sizes) with its
breakdown. Nothing is allocated: the model is built on the meta device (see estimator/).

  python -m fairseq_fsdp2.estimate unused --task translation --vocab-size 256206 \\
      --arch transformer_nllb_600m --max-tokens 4096 --ddp-backend fsdp2 \\
      --min-params-to-wrap 1 --fp16 --optimizer adam --world-size 8
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from fairseq import options

from .estimator import from_args
from .estimator.from_args import DEFAULT_SEQ_LEN
from .estimator.peak import CPU_BASELINE_GB, Estimate, format_summary


def add_estimator_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("memory estimate (python -m fairseq_fsdp2.estimate)")
    group.add_argument("--world-size", type=int, nargs="+", default=None,
                       help="number of ranks; several values print one row each "
                            "(default: --distributed-world-size)")
    group.add_argument("--replicate-degree", type=int, default=None,
                       help="HSDP replicas (default: --fsdp2-replicate-degree)")
    group.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="cpu: peak resident memory incl. the runtime baseline; cuda: "
                            "allocator peak (default: cpu with --cpu, else cuda)")
    group.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                       help="tokens per sentence, source and target (default 128)")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="dictionary size to build the model with, instead of DATA's")
    group.add_argument("--cpu-baseline-gb", type=float, default=None,
                       help=f"CPU runtime baseline in GiB (default: {CPU_BASELINE_GB} plus the "
                            f"dictionaries, measured on this project's machine)")


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = options.get_training_parser()
    add_estimator_args(parser)
    return options.parse_args_and_arch(parser, list(argv) if argv is not None else None)


def estimate_args(argv: Sequence[str]) -> list[Estimate]:
    """Parse fairseq-train arguments (+ the estimator's) and estimate every world size."""
    return from_args.estimates(parse(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    estimates = estimate_args(sys.argv[1:] if argv is None else argv)
    if len(estimates) == 1:
        print(estimates[0].table())
    else:
        print(format_summary(estimates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
