"""fairseq's precision flags, mapped onto FSDP2.

Master weights are the sharded fp32 parameters in every mode; ``--fp16``/``--bf16`` set the
compute dtype through ``MixedPrecisionPolicy`` (gradients are reduced in fp32).
``--memory-efficient-fp16`` means the same as ``--fp16`` here: there is no separate fp32 copy of
the weights to save, as with fairseq's legacy FSDP. fp16 keeps fairseq's dynamic loss scaling
(``--fp16-init-scale``, ``--fp16-scale-window``, ``--min-loss-scale``) through fairseq's own
``MemoryEfficientFP16Optimizer``, which scales the loss and unscales the (sharded) gradients.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn
from fairseq import optim
from omegaconf import open_dict
from torch.distributed.fsdp import MixedPrecisionPolicy

from .factored_state import use_factored_state
from .grad_norm import use_global_grad_norm
from .local_shards import use_local_shards


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


def build_optimizer(cfg, params, local_shards: bool = True):
    """fairseq's optimizer over the sharded fp32 parameters; fp16 adds the loss scaler.

    Two GPU-only choices of fairseq are undone for DTensor parameters: with apex installed,
    fairseq's Adam becomes apex's FusedAdam, whose kernels take plain CUDA tensors (not
    DTensors, not offloaded CPU shards): ``use_old_adam`` keeps fairseq's own Adam, as on
    machines without apex. And the gradient norm is the global one over DTensor gradients
    (grad_norm.py), whatever fairseq's helper would compute; elementwise work (Adam's step,
    scaling the gradients) runs on the local shards (local_shards.py; ``local_shards=False``
    leaves it to DTensor dispatch, the reference the tests and the benchmark compare with);
    Adafactor's factored statistics are made DTensors (factored_state.py)."""
    optimizer_cfg = cfg.optimizer
    if "use_old_adam" in optimizer_cfg:
        optimizer_cfg = copy.deepcopy(optimizer_cfg)  # the run's saved cfg stays the user's
        with open_dict(optimizer_cfg):
            optimizer_cfg.use_old_adam = True
    inner = optim.build_optimizer(optimizer_cfg, params)
    use_global_grad_norm(inner, local_shards)
    if local_shards:
        use_local_shards(inner.optimizer)  # elementwise optimizers step on the local shards
    use_factored_state(inner.optimizer)  # Adafactor: its row and column statistics sharded
    if cfg.common.fp16:
        # After loading optimizer state, fairseq's wrapper copies the saved state back over
        # what torch loaded, lest torch cast it to fp16 parameters. Here the parameters are
        # fp32 and the saved state a reference to the shards (no "param_groups": resuming
        # an --fp16 run failed with a KeyError): its own switch turns that copy off.
        inner.optimizer.disable_mem_eff_fp16_loading_hack = True
        # allow_unsupported: the parameters are fp32 master weights, so any fairseq optimizer
        # is valid under the scaler (the same choice fairseq makes for legacy FSDP + --fp16).
        return optim.MemoryEfficientFP16Optimizer(cfg, params, inner, allow_unsupported=True)
    return inner
