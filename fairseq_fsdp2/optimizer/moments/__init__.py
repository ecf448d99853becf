"""Adam's moments between steps, one format per flag, each behind one interface (format.py's
MomentFormat: its name, stored dtype, side keys, widen, narrow, bytes and temporaries): float32
(fp32.py, fairseq's own), fp16 with fairseq's scales and bf16 rounded stochastically
(sixteen_bit.py, stochastic_round.py), 8 bits block-wise (eight_bit.py; the format
blockwise_8bit.py, its C++ CPU kernel kernels.py and csrc/). Also what a checkpoint's load needs
of them (fit_saved_state.py) and the per-thread buffers the conversions keep
(thread_buffers.py).

The step (optimizer/adam_stats.py, optimizer/row_chunk_step.py) and the estimator
(estimator/ledger.py) reach a format only through ``named`` and ``stored_format`` below: a new
format is a new MomentFormat registered in FORMATS, and nothing outside this folder changes
(tests/test_layout.py checks that no module outside it names a moment dtype or a side key;
tests/test_moment_formats.py that every format implements the interface and FORMATS matches
settings.MOMENT_FORMATS).
"""
from __future__ import annotations

from typing import Optional

from .eight_bit import EIGHT_BIT
from .format import MOMENTS, MomentFormat
from .fp32 import FP32
from .sixteen_bit import BF16, FP16

#: every format, by name (settings.MOMENT_FORMATS: the flags' values)
FORMATS: dict[str, MomentFormat] = {f.name: f for f in (FP32, FP16, BF16, EIGHT_BIT)}
#: the formats by stored dtype
_BY_DTYPE = {f.dtype: f for f in FORMATS.values()}
#: stored dtypes narrower than float32: torch's load_state_dict would cast them
#: (optimizer/adam_stats.py holds them through it)
NARROW_DTYPES = frozenset(f.dtype for f in FORMATS.values() if f is not FP32)
__all__ = ["FORMATS", "MOMENTS", "MomentFormat", "NARROW_DTYPES", "named", "side_keys",
           "stored_format"]


def named(name: str) -> MomentFormat:
    """The format called ``name`` (``fp32``, ``fp16``, ``bf16``, ``8bit``)."""
    return FORMATS[name]


def side_keys(key: str) -> list[str]:
    """Every format's side key of moment ``key`` (a state changing format drops them all)."""
    return [f.side_key(key) for f in FORMATS.values() if f.side_key(key)]


def stored_format(state: dict, key: str) -> Optional[MomentFormat]:
    """The format of what ``state`` (one parameter's) holds for moment ``key`` (None: nothing
    yet), whatever the run's: known by its dtype; a tensor of a format without a side but with
    fp16's scale beside it (a float32 or bf16 one) is read as fp16's, its values times the
    scale."""
    value = state.get(key)
    if value is None:
        return None
    fmt = _BY_DTYPE.get(value.dtype)
    if fmt is None:
        raise ValueError(f"Adam's {key} is stored as {value.dtype}: no moment format "
                         f"stores that ({', '.join(FORMATS)})")
    if fmt.side_key(key) is None and FP16.side_key(key) in state:
        return FP16
    return fmt
