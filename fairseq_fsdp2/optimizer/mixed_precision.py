"""fairseq's precision flags, mapped onto FSDP2.

Master weights are the sharded fp32 parameters in every mode; ``--fp16``/``--bf16`` set the
compute dtype through ``MixedPrecisionPolicy`` (gradients are reduced in fp32).
``--memory-efficient-fp16`` means the same as ``--fp16`` here: there is no separate fp32 copy of
the weights to save, as with fairseq's legacy FSDP. fp16's dynamic loss scaling is fairseq's own
(build.py, loss_scale.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy


def compute_dtype(common_cfg) -> Optional[torch.dtype]:
    if common_cfg.fp16:
        return torch.float16
    if common_cfg.bf16:
        return torch.bfloat16
    return None


def mixed_precision_policy(common_cfg) -> Optional[MixedPrecisionPolicy]:
    dtype = compute_dtype(common_cfg)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def cast_float_buffers(model: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """Cast floating buffers to the compute dtype, as ``model.half()`` does in stock fairseq.

    FSDP2 casts parameters only; an fp32 buffer (fairseq's sinusoidal positions follow one)
    would otherwise promote activations back to fp32 inside the root unit.
    """
    if dtype is None:
        return
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = buf.to(dtype)
