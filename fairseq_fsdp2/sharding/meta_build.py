"""Build the model on the meta device when its weights will be loaded anyway.

fairseq builds the full model, randomly initialised, on every rank before the trainer sees it:
for NLLB 3.3B that is 13 GiB of host memory per rank, for weights that ``--finetune-from-model``
or a resumed checkpoint overwrite at once. When a run will load weights, the plugin has fairseq
build the model on the ``meta`` device (shapes only, no memory); the trainer shards it
(``fully_shard`` works on meta modules), allocates only this rank's shards (``to_empty``) and
recomputes the non-persistent buffers no checkpoint holds. The load then fills every parameter
and persistent buffer (strictly; the trainer refuses to train a meta-built model nothing was
loaded into).

A model with a non-persistent buffer this module cannot recompute is built on meta, found
wanting, and built again normally (logged): correctness first.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn as nn
from fairseq.modules.sinusoidal_positional_embedding import SinusoidalPositionalEmbedding

logger = logging.getLogger(__name__)

#: How to recompute each module type's non-persistent buffers: module -> {name: tensor}.
RECIPES: dict[type, Callable[[nn.Module], dict[str, torch.Tensor]]] = {
    SinusoidalPositionalEmbedding: lambda m: {"weights": m.get_embedding(
        m.weights.shape[0], m.embedding_dim, m.padding_idx)},
}

def build_model(fairseq_build_model, task, cfg, *args, on_meta: bool, **kwargs) -> nn.Module:
    """Stand-in for fairseq's FairseqTask.build_model (integration/registration.py):
    ``on_meta`` when an FSDP2 run will load the weights (its run context says so,
    process/run_context.py); otherwise fairseq's own build."""
    if not on_meta:
        return fairseq_build_model(task, cfg, *args, **kwargs)
    with torch.device("meta"):
        model = fairseq_build_model(task, cfg, *args, **kwargs)
    unknown = sorted({type(m).__name__ for m in model.modules()
                      if m._non_persistent_buffers_set and type(m) not in RECIPES})
    if unknown:
        logger.info(f"building the model in full: cannot recompute the non-persistent buffers "
                    f"of {', '.join(unknown)} after a meta-device build")
        return fairseq_build_model(task, cfg, *args, **kwargs)
    model.fsdp2_built_on_meta = True
    logger.info("model built on the meta device: its weights come from the checkpoint, each "
                "rank allocates only its shards")
    return model


def built_on_meta(model: nn.Module) -> bool:
    return getattr(model, "fsdp2_built_on_meta", False)


def materialize(model: nn.Module, device: torch.device,
                params_device: Optional[torch.device] = None) -> None:
    """After sharding: allocate this rank's shards (uninitialised: the load fills them) on
    ``params_device`` (default ``device``; the CPU with --cpu-offload) and the buffers on the
    compute ``device``, where FSDP2 keeps them too, and recompute the non-persistent buffers."""
    model.to_empty(device=params_device or device)
    with torch.no_grad():
        for module in model.modules():
            if params_device is not None and params_device != device:
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = torch.empty_like(buffer, device=device)
            recipe = RECIPES.get(type(module))
            if recipe is not None:
                for name, value in recipe(module).items():
                    buffer = getattr(module, name)
                    buffer.copy_(value.to(buffer.dtype))
