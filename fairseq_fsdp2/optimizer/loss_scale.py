"""fairseq's dynamic loss scaler (``--fp16``), saved whole for an exact resume."""
from __future__ import annotations

from typing import Optional


#: Where fairseq's DynamicLossScaler stands in its --fp16-scale-window (updates since the last
#: overflow and rescale). fairseq saves the scale alone, so its resumed runs double the scale at
#: other updates than the uninterrupted run; saved here beside it for an exact resume. fairseq's
#: private attributes (no public ones; the pinned fairseq 0.12.3.1): a rename fails every save
#: of an --fp16 run with an AttributeError (tests/test_checkpoints.py resumes one).
SCALER_COUNTS = ("_iter", "_last_overflow_iter", "_last_rescale_iter", "_overflows_since_rescale")


def scaler_counts(optimizer) -> Optional[dict]:
    """The loss scaler's window counts of a fairseq optimizer, or None without a scaler."""
    scaler = getattr(optimizer, "scaler", None)
    return None if scaler is None else {k: getattr(scaler, k) for k in SCALER_COUNTS}


def restore_scaler_counts(optimizer, counts: Optional[dict]) -> None:
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None and counts:
        for key in SCALER_COUNTS:
            getattr(scaler, key)  # exists: fails loudly if fairseq renamed it
            setattr(scaler, key, counts[key])
