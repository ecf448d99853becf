"""float32 moments, as fairseq's Adam keeps them: stepped where they are stored (no widening),
nothing beside them."""
from __future__ import annotations

import torch

from .format import MomentFormat


class Fp32(MomentFormat):
    """fairseq's own moments (4 bytes an element); also what 8 bits leave a small parameter."""

    name = "fp32"
    dtype = torch.float32
    element_bytes = 4
    widened_bytes = 0

    def widen(self, stored, side, key, out=None):
        return stored if out is None else out.copy_(stored)

    def narrow(self, wide, key, generator=None, dest=None, side=None):
        if dest is None:
            return wide, None
        if wide.data_ptr() != dest.data_ptr():  # else the step updated the stored rows
            dest.copy_(wide)
        return dest, None

    def narrow_bytes(self, elements: int) -> int:
        return 0


FP32 = Fp32()
