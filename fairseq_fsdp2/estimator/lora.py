"""The estimator's LoRA (``--lora-rank``, docs/lora.md): the meta model adapted as the trainer
adapts it, and what trains and what is frozen in each unit.

What changes in the simulated step (fsdp2_step.py asks ``trained_sizes``):
- sharded parameters: the frozen ones in the compute dtype, the trained ones (adapters,
  --lora-train-params) in fp32;
- all-gathers: the whole unit in the compute dtype, as before (the adapters included);
- gradients, reduce-scatter buffers, optimizer state and the step's temporaries: of the trained
  parameters only; the tied embedding, frozen, gets no vocab x dim gradient;
- activations: the trace runs the adapted model, whose attention takes fairseq's Python path
  (models/lora.py), the same on every device: the attention probabilities are saved on GPUs
  too (``adapt`` makes the profile's CUDA trace the traced one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from ..models import lora
from ..options import lora_modules, lora_scaling, lora_train_patterns
from ..sharding.plan import ROOT
from .ledger import shard_rows


def adapt(model: nn.Module, args) -> bool:
    """Adapt the meta model as the FSDP2 trainer does with ``args``' --lora-* options; False
    (nothing done) without --lora-rank."""
    if int(getattr(args, "lora_rank", 0) or 0) <= 0:
        return False
    if lora.spec_of(model) is not None:  # (the fit's trials reuse one model)
        return True
    lora.adapt(model, args.lora_rank, lora_scaling(args), float(args.lora_dropout or 0.0),
               lora_modules(args), lora_train_patterns(args),
               bool(getattr(args, "lora_train_new_rows", False)))
    return True


def attach(profile, model: nn.Module) -> None:
    """Record on ``profile`` which of each unit's parameters train (in unit_specs' order) and
    which layer parameters do; the CUDA trace is the traced attention (module docstring)."""
    modules = dict(model.named_modules())
    seen: set[int] = set()
    trained = {}
    for spec in profile.units:
        targets = [model] if spec.kind == ROOT else [modules[p] for p in spec.module_paths]
        flags = []
        for m in targets:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    flags.append(p.requires_grad)
        trained[spec.name] = flags
    layers = {path: sum(p.numel() for p in modules[path].parameters() if p.requires_grad)
              for path in profile.layer_params}
    embedding = modules[profile.embed_paths[0]].weight.requires_grad
    profile.lora = LoraProfile(trained, layers, embedding)
    profile.traces["cuda"] = profile.traces["cpu"]


@dataclass
class LoraProfile:
    trained: dict  # unit name -> per parameter (unit_specs' order): trains?
    layer_params: dict  # layer path -> its trained elements
    embedding_trained: bool


@dataclass
class TrainedSizes:
    """Per unit on one rank: elements of the trained parameters (local shard, padded whole),
    elements of the frozen ones (local); the trained parameters' shapes; each layer's trained
    elements; whether the tied embedding trains."""

    local: dict
    padded: dict
    numel: dict
    largest: int  # the largest trained shard
    frozen_local: dict
    shapes: list
    layer_params: dict
    embedding_trained: bool


def trained_sizes(profile, shards: int, rank: int) -> Optional[TrainedSizes]:
    """The trained and frozen sizes of a LoRA profile on ``rank`` of ``shards``; None if the
    model trains in full."""
    info = getattr(profile, "lora", None)
    if info is None:
        return None
    local, padded, numel, frozen, shapes, largest = {}, {}, {}, {}, [], 0
    for spec in profile.units:
        local[spec.name] = padded[spec.name] = numel[spec.name] = frozen[spec.name] = 0
        for shape, trains in zip(spec.shapes, info.trained[spec.name]):
            rest = 1
            for n in shape[1:]:
                rest *= n
            rows, chunk = shard_rows(shape[0], shards, rank)
            if trains:
                local[spec.name] += rows * rest
                padded[spec.name] += chunk * shards * rest
                numel[spec.name] += shape[0] * rest
                largest = max(largest, rows * rest)
                shapes.append(shape)
            else:
                frozen[spec.name] += rows * rest
    return TrainedSizes(local, padded, numel, largest, frozen, shapes, info.layer_params,
                        info.embedding_trained)
