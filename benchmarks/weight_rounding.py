"""Imported by a benchmark's ranks first (worker.py's ``--import=``, as update_timers.py): how
the bf16 weights of ``--memory-efficient-bf16`` are written back in this run, named by the
environment variable BENCHMARK_WEIGHT_ROUNDING:

- unset or empty: the plugin's own (stochastic rounding);
- ``nearest``: rounded to nearest (``RowChunkSteps.round_weights_to_nearest``, the control of
  tests/test_bf16_weights.py: tests/probes/nearest_weights.py sets it so);
- ``other-draws``: stochastic rounding drawing other random numbers (the seed offset of
  tests/probes/other_rounding_draws.py; the data order, dropout and initialisation untouched):
  the twin whose distance from the plain run is the rounding's own noise.
"""
from __future__ import annotations

import os
import sys

from fairseq_fsdp2.optimizer import build
from fairseq_fsdp2.optimizer.row_chunk_step import RowChunkSteps

from .harness import ROOT

VARIABLE = "BENCHMARK_WEIGHT_ROUNDING"
KINDS = ("", "nearest", "other-draws")


def install(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"{VARIABLE}={kind!r}: expected one of {KINDS[1:]} or nothing")
    if kind == "nearest":
        RowChunkSteps.round_weights_to_nearest = True
    elif kind == "other-draws":
        sys.path.insert(0, str(ROOT / "tests" / "probes"))  # test code, as loss_sweep's probe
        from other_rounding_draws import with_other_draws
        build.use_16_bit_moments = with_other_draws(build.use_16_bit_moments)


install(os.environ.get(VARIABLE, ""))
