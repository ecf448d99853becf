"""``python -m fairseq_fsdp2.estimate``: predicted per-rank peak memory of a fairseq-train run.

Takes fairseq-train's own arguments (parsed by fairseq's parser, with this plugin's options) plus

  --world-size N [N ...]   ranks (default: --distributed-world-size); several give one row each
  --replicate-degree R     HSDP replicas (default: --fsdp2-replicate-degree)
  --device {cpu,cuda}      what "peak" means: CPU resident memory (adds the runtime baseline) or
                           CUDA allocator peak (default: cpu with --cpu, else cuda)
  --seq-len L              tokens per sentence, source and target (default 128)
  --vocab-size V           build the dictionary with V entries instead of reading DATA's
  --cpu-baseline-gb X      CPU runtime baseline (default: the value measured on this machine)
  --fit-gb G               also print the largest --max-tokens predicted to fit G GiB per rank

and prints the predicted peak of each class of ranks (ranks with equal shard sizes) with its
breakdown. Nothing is allocated: the model is built on the meta device (see estimator/).

  python -m fairseq_fsdp2.estimate unused --task translation --vocab-size 256206 \\
      --arch transformer_nllb_600m --max-tokens 4096 --ddp-backend fsdp2 \\
      --min-params-to-wrap 1 --fp16 --optimizer adam --world-size 8
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from .errors import OptionError, report_bad_input
from .estimator import from_args
from .estimator.fit import largest_max_tokens
from .estimator.peak import Estimate, format_summary
from .process import quiet


def estimate_args(argv: Sequence[str],
                  models: Optional[from_args.ModelCache] = None) -> list[Estimate]:
    """Parse fairseq-train arguments (+ the estimator's) and estimate every world size
    (``models``: the caller's meta models, from_args.ModelCache)."""
    return from_args.estimates(from_args.parse(argv), models)


PROG = "fairseq_fsdp2.estimate"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command: 0, or 2 after one line on stderr for bad input."""
    args = from_args.parse(sys.argv[1:] if argv is None else argv)
    if args.fit_gb is not None and args.fit_gb <= 0:
        return report_bad_input(PROG, f"--fit-gb {args.fit_gb:g}: give the memory per rank in "
                                      f"GiB, a positive number")
    models = from_args.ModelCache()  # the model built once, for the estimate and the fit
    try:
        estimates = from_args.estimates(args, models)
    except OptionError as e:  # settings the estimator refuses, as training would
        return report_bad_input(PROG, e)
    if len(estimates) == 1:
        print(estimates[0].table())
    else:
        print(format_summary(estimates))
    if args.fit_gb is not None:
        for fit in largest_max_tokens(args, args.fit_gb, [e.setup.world_size for e in estimates],
                                      models=models):
            print(fit.line())
    return 0


if __name__ == "__main__":
    quiet.no_debug_log()
    sys.exit(main())
