"""LoRA: low-rank adapters on fairseq's linear modules (``--lora-rank``, docs/lora.md).

An adapted ``nn.Linear`` keeps its ``weight`` and ``bias`` (the base, frozen: the keys of stock
checkpoints, so every loading path fits unchanged) and gains two parameters, ``lora_A``
(rank x in) and ``lora_B`` (out x rank, zero at the start), with

    y = x W^T + b + scaling x (dropout(x) A^T) B^T,    scaling = alpha / rank,

PEFT's LoRA layer's formula and initialisation (A: kaiming-uniform with a = sqrt(5), as
``nn.Linear``'s own weight; B: zeros), so the adapted model starts equal to the base and a PEFT
adapter directory holds the same tensors (hf/lora_adapter.py). The class is changed on the
instance (as ``fully_shard`` itself does); nothing is copied from the module.

Why not PEFT's own layer: PEFT imports transformers (``import peft`` does), which the plugin's
runtime does not have, and its layers wrap the base module (new keys ``base_layer.weight``),
which stock checkpoints and the sharded loading paths would then not fit; under FSDP2 its
mixed Tensor/DTensor parameters and its adapter/base dtype casts are known to break (docs/lora.md).

fairseq's attention runs PyTorch's fused ``F.multi_head_attention_forward`` in training, which
reads the projections' weights directly and would skip the adapters: an attention module with
an adapted projection runs fairseq's own Python path instead (the one incremental decoding, and
so fairseq-generate, always takes), by fairseq's switch ``skip_embed_dim_check``.
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import OptionError

LORA_A = "lora_A"
LORA_B = "lora_B"
#: the model attribute holding its LoraSpec once adapted
SPEC_ATTRIBUTE = "fsdp2_lora"


class LoraSpec:
    """What ``adapt`` did: rank, scaling, dropout, the adapted modules' paths."""

    def __init__(self, rank: int, scaling: float, dropout: float, modules: list[str],
                 train_patterns: list[str], new_rows: Optional[str] = None):
        self.rank, self.scaling, self.dropout = rank, scaling, dropout
        self.modules, self.train_patterns = modules, train_patterns
        #: --lora-train-new-rows: the name of the embedding whose added rows train
        self.new_rows = new_rows


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with adapters (module docstring); made by ``adapt``, never built."""

    lora_scaling: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.lora_scaling


def matches(path: str, name: str) -> bool:
    """A --lora-modules name matches a module path that ends with it (on a dot)."""
    return path == name or path.endswith("." + name)


#: the shared embedding whose added rows --lora-train-new-rows trains
EMBEDDING = "encoder.embed_tokens.weight"


def adapt(model: nn.Module, rank: int, scaling: float, dropout: float, names: list[str],
          train_patterns: Iterable[str] = (), new_rows: bool = False) -> LoraSpec:
    """Give every ``nn.Linear`` whose path ends with one of ``names`` adapters, freeze every
    other parameter except those whose names match a ``train_patterns`` regular expression
    (and, ``new_rows``, the shared embedding, whose pretrained rows the trainer keeps).
    OptionError (one line) for a name that matches no linear module."""
    linears = [(p, m) for p, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        if not any(matches(p, name) for p, _ in linears):
            known = sorted({p.rsplit(".", 1)[-1] for p, _ in linears})
            raise OptionError(f"--lora-modules {name}: no linear module of the model is named "
                              f"so (its linear modules: {', '.join(known)})")
    adapted = []
    for path, module in linears:
        if any(matches(path, n) for n in names):
            kind = dict(device=module.weight.device, dtype=torch.float32)
            module.lora_A = nn.Parameter(torch.zeros(rank, module.in_features, **kind))
            module.lora_B = nn.Parameter(torch.zeros(module.out_features, rank, **kind))
            module.lora_scaling, module.lora_dropout = scaling, dropout
            module.__class__ = LoraLinear
            adapted.append(path)
    for path, module in model.named_modules():
        if hasattr(module, "skip_embed_dim_check") and any(
                isinstance(c, LoraLinear) for c in module.children()):
            module.skip_embed_dim_check = True  # fairseq's Python path (module docstring)
    patterns = [re.compile(p) for p in train_patterns]
    params = dict(model.named_parameters())
    if new_rows and EMBEDDING not in params:
        raise OptionError(f"--lora-train-new-rows: the model has no shared embedding "
                          f"({EMBEDDING})")
    for name, param in params.items():
        param.requires_grad = is_adapter(name) or any(p.search(name) for p in patterns) or \
            (new_rows and name == EMBEDDING)
    spec = LoraSpec(rank, scaling, dropout, adapted, list(train_patterns),
                    EMBEDDING if new_rows else None)
    setattr(model, SPEC_ATTRIBUTE, spec)
    return spec


def spec_of(model: nn.Module) -> Optional[LoraSpec]:
    return getattr(model, SPEC_ATTRIBUTE, None)


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in (LORA_A, LORA_B)


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' starting values by parameter name, full size, the same on every rank
    (drawn from a generator seeded with ``seed``, in module order): A kaiming-uniform with
    a = sqrt(5) (bound 1 / sqrt(in), as PEFT and ``nn.Linear``), B zeros."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for path, module in model.named_modules():
        if isinstance(module, LoraLinear):
            rank, fan_in = module.lora_A.shape
            bound = 1.0 / math.sqrt(fan_in)
            values[f"{path}.{LORA_A}"] = (torch.rand(rank, fan_in, generator=generator)
                                          * 2 - 1) * bound
            values[f"{path}.{LORA_B}"] = torch.zeros(module.lora_B.shape)
    return values


def merged(full: dict, scaling: float) -> dict:
    """A full state dict with adapters -> the base's keys only, each adapted weight merged:
    W + scaling x B A, computed in float64 and stored in float32 (or float64, if the weight
    is); the frozen 16-bit tensors of a --fp16/--bf16 run become float32 too (exactly), so the
    export is one dtype, as a stock float32 checkpoint. A tied weight stays one tensor."""
    out, cast = {}, {}

    def widened(value):
        if value.dtype not in (torch.float16, torch.bfloat16):
            return value
        return cast.setdefault(id(value), value.float())

    for key, value in full.items():
        if is_adapter(key):
            continue
        base = key[:-len(".weight")] if key.endswith(".weight") else None
        if base is not None and f"{base}.{LORA_A}" in full:
            a, b = full[f"{base}.{LORA_A}"], full[f"{base}.{LORA_B}"]
            dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
            value = (value.double() + scaling * (b.double() @ a.double())).to(dtype)
        out[key] = widened(value)
    return out


def cast_frozen(model: nn.Module, dtype: Optional[torch.dtype]) -> int:
    """Store every frozen floating parameter in ``dtype`` (the compute dtype: no fp32 master
    copy of weights that never change); the Parameter objects stay (ties kept). Returns how
    many elements were cast."""
    if dtype is None:
        return 0
    count = 0
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                count += param.numel()
    return count
