"""``python -m benchmarks.worker [--import=MODULE ...] FAIRSEQ_TRAIN_ARGS``: one
rank of a benchmark (harness.launch starts it with torchrun's environment). Imports each MODULE
first (a probe that patches fairseq's Trainer, e.g. tests/probes/count_all_gathers.py, found on
PYTHONPATH), then runs fairseq-train with the stock Trainer's per-rank memory log
(harness.worker). The plugin is imported before anything else, as it was while this module was
part of the package: every configuration, legacy_ddp's too, runs with its patches installed."""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

import fairseq_fsdp2  # noqa: F401  (the plugin installed before anything else)

from .harness import worker

FLAG = "--import="


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    while argv and argv[0].startswith(FLAG):
        importlib.import_module(argv.pop(0)[len(FLAG):])
    worker(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
