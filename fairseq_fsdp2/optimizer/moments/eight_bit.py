"""Moments in 8 bits (``--eight-bit-adam-stats``, the plugin's): each parameter of at least
blockwise_8bit.MIN_NUMEL elements and two dimensions (sharded by rows) keeps its moments as uint8
codes shaped like it (1 byte an element) and float32 block maxima beside them
(``exp_avg_absmax``, ``exp_avg_sq_absmax``: one per BLOCK elements of a row), both sharded like
the parameter's rows, so DCP reshards them; smaller ones keep float32 moments. The codes are
rounded stochastically, from the generator the step gives (as bf16's). The format itself, its
tables and its C++ kernel: blockwise_8bit.py, kernels.py, csrc/.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from ...sharding.mesh import local_part
from .blockwise_8bit import (CHUNK, TEMPORARY_BYTES, absmax_shape, dequantize, quantizable,
                             quantize, rows_like)
from .format import MomentFormat, like, rows_sharded
from .fp32 import FP32

#: the float32 block maxima of each moment's codes
ABSMAX_KEYS = {"exp_avg": "exp_avg_absmax", "exp_avg_sq": "exp_avg_sq_absmax"}
#: the first moment's map is signed, the second's unsigned
SIGNED = {"exp_avg": True, "exp_avg_sq": False}


class EightBit(MomentFormat):
    name = "8bit"
    dtype = torch.uint8
    side_keys = ABSMAX_KEYS
    element_bytes = None  # 1 and the block maxima, or float32's 4: moment_bytes
    widened_bytes = 4
    draws = True

    def for_parameter(self, p):
        return self if quantizable(p.shape) and rows_sharded(p) else FP32

    def widen(self, stored, side, key, out=None):
        wide = dequantize(local_part(stored), local_part(side), SIGNED[key], out=out)
        return wide if out is not None else like(wide, stored)

    def narrow(self, wide, key, generator=None, dest=None, side=None):
        codes, absmax = quantize(local_part(wide), SIGNED[key], generator, codes=dest,
                                 absmax=side)
        if dest is None and isinstance(wide, DTensor):
            return like(codes, wide), rows_like(absmax, wide)
        return codes, absmax

    def empty(self, local):
        return (torch.empty(local.shape, dtype=self.dtype, device=local.device),
                torch.empty(absmax_shape(local.shape), dtype=torch.float32, device=local.device))

    def side_rows(self, side, a, b):
        return side[a:b]

    def laid_out(self, stored, side, p):
        if not isinstance(stored, DTensor):
            stored = like(stored, p)
        if not isinstance(side, DTensor):
            side = rows_like(side, p)
        return stored, side

    def placeholder(self, value):
        local = local_part(value)
        return rows_like(torch.zeros((local.shape[0], absmax_shape(value.shape)[1]),
                                     device=local.device), value)

    def moment_bytes(self, shape, rows):
        row = math.prod(shape[1:])
        if not quantizable(shape):
            return FP32.moment_bytes(shape, rows)
        return rows * row + 4 * rows * absmax_shape(shape)[1]

    def narrow_bytes(self, elements: int) -> int:
        """What the estimator allows for quantizing a chunk (blockwise_8bit.TEMPORARY_BYTES
        says why: a bound on WORK_BYTES over CHUNK)."""
        return TEMPORARY_BYTES * min(CHUNK, elements)


EIGHT_BIT = EightBit()
