"""fairseq's precision flags, mapped onto FSDP2.

Master weights are the sharded fp32 parameters in every mode but one (below); ``--fp16``/
``--bf16`` set the compute dtype through ``MixedPrecisionPolicy``; gradients are reduced in fp32, or with
``--fsdp2-reduce-dtype fp16/bf16`` in the compute dtype (FSDP2 then reduce-scatters the 16-bit
gradients as they are, pre- and post-dividing by about sqrt(world size) in fp16: see
docs/compatibility.md).
``--memory-efficient-fp16`` means the same as ``--fp16`` here: there is no separate fp32 copy of
the weights to save, as with fairseq's legacy FSDP. fp16's dynamic loss scaling is fairseq's own
(build.py, loss_scale.py). ``--memory-efficient-bf16`` with fairseq's Adam stores the sharded
parameters themselves in bf16 (settings.keeps_bf16_weights; the trainer casts them, the step
rounds each update back stochastically: row_chunk_step.py); the policy below then casts nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy


def compute_dtype(common_cfg) -> Optional[torch.dtype]:
    if common_cfg.fp16:
        return torch.float16
    if common_cfg.bf16 or getattr(common_cfg, "memory_efficient_bf16", False):
        return torch.bfloat16  # fairseq's parser sets --bf16 with it; a hydra config may not
    return None


#: --fsdp2-reduce-dtype's values
REDUCE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def reduce_dtype(dt_cfg) -> torch.dtype:
    """--fsdp2-reduce-dtype (options.py checked it against the compute dtype)."""
    return REDUCE_DTYPES[str(getattr(dt_cfg, "fsdp2_reduce_dtype", "fp32") or "fp32")]


def mixed_precision_policy(common_cfg, dt_cfg=None) -> Optional[MixedPrecisionPolicy]:
    dtype = compute_dtype(common_cfg)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype(dt_cfg))


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
