"""The model as data for the memory estimator: units, the forward trace, the workload.

``build_profile`` turns a (meta-device) fairseq model, its sharding plan and a workload into a
``ModelProfile``: each unit's parameter shapes, which modules own which unit, and the forward's
activation events traced on the meta device (``forward_trace.py``; see ``peak.py`` for the
modelling rules).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from fairseq.data import Dictionary
from fairseq.modules import LayerDropModuleList

from ..sharding.plan import ROOT, ShardingPlan, build_plan, layer_candidates
from .forward_trace import ForwardTrace, Workload, resolve, trace_forward


PRECISIONS = {"fp32": (torch.float32, 4), "fp16": (torch.float16, 2), "bf16": (torch.bfloat16, 2)}
BACKENDS = ("fsdp2", "legacy_ddp")

# -- the model, as data -----------------------------------------------------------------------

@dataclass
class UnitSpec:
    name: str
    kind: str  # ROOT, SHARED or LAYER (sharding/plan.py)
    module_paths: tuple[str, ...]
    shapes: list[tuple[int, ...]]
    reshard: object  # plan.Unit.reshard_after_forward

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass
class ModelProfile:
    """Everything the simulation needs from the model: units, sizes, the forward trace."""

    units: list[UnitSpec]
    owner: dict[str, str]  # module path (layers, unit modules) -> unit name owning its params
    layer_params: dict[str, int]  # layer path -> number of parameters
    embed_paths: tuple[str, ...]  # modules that look up the tied embedding
    output_paths: tuple[str, ...]  # the output projection
    vocab: int
    embed_dim: int
    total_params: int
    buffer_bytes: int
    plan: ShardingPlan
    trace: ForwardTrace
    workload: Workload
    compute_bytes: int
    traces: dict = field(default_factory=dict)  # device -> ForwardTrace (attention differs)

    def trace_for(self, device: str) -> ForwardTrace:
        return self.traces.get(device, self.trace)


# -- building the profile ---------------------------------------------------------------------

def unit_specs(model: nn.Module, plan: ShardingPlan) -> list[UnitSpec]:
    """The plan's units with the shapes of the parameters each manages (same rules as
    sharding/plan.py: inner units first, a parameter belongs to the first unit that reaches it)."""
    modules = dict(model.named_modules())
    seen: set[int] = set()
    specs = []
    for u in plan.units:
        targets = [model] if u.kind == ROOT else [modules[p] for p in u.module_paths]
        shapes = []
        for m in targets:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    shapes.append(tuple(p.shape) or (1,))
        specs.append(UnitSpec(u.name, u.kind, u.module_paths, shapes, u.reshard_after_forward))
    return specs


def _owners(model: nn.Module, specs: list[UnitSpec]) -> dict[int, str]:
    modules = dict(model.named_modules())
    owner: dict[int, str] = {}
    for s in specs:
        targets = [model] if s.kind == ROOT else [modules[p] for p in s.module_paths]
        for m in targets:
            for p in m.parameters():
                owner.setdefault(id(p), s.name)
    return owner


def workload_for(max_tokens: Optional[int], batch_size: Optional[int], seq_len: int,
                 batch_multiple: int = 8) -> Workload:
    """The largest batch fairseq forms: max_tokens // seq_len sentences, rounded down to
    --required-batch-size-multiple (when there are at least that many), capped by --batch-size."""
    if max_tokens:
        b = max(max_tokens // seq_len, 1)
        if batch_multiple > 1 and b >= batch_multiple:
            b -= b % batch_multiple
        if batch_size:
            b = min(b, batch_size)
    elif batch_size:
        b = batch_size
    else:
        raise ValueError("the estimate needs --max-tokens or --batch-size")
    return Workload(tokens=b * seq_len, batch=b, seq_len=seq_len)


def build_profile(model: nn.Module, workload: Workload, *, precision: str = "fp32",
                  min_params_to_wrap: int = int(1e8), checkpoint_activations: bool = False,
                  no_reshard_after_forward: bool = False, reshard_degree: int = 0,
                  root_reshard: str = "default", chunked_loss: bool = False) -> ModelProfile:
    """The profile of a fairseq encoder-decoder ``model`` (built on the meta device) for one
    micro-batch. ``model`` is not modified."""
    plan = build_plan(model, world_size=2, min_params_to_wrap=min_params_to_wrap,
                      checkpoint_activations=checkpoint_activations,
                      no_reshard_after_forward=no_reshard_after_forward,
                      reshard_degree=reshard_degree, root_reshard=root_reshard)
    specs = unit_specs(model, plan)
    owner_of_param = _owners(model, specs)
    modules = dict(model.named_modules())
    layers = [p for p, _ in layer_candidates(model)]
    owner, layer_params = {}, {}
    for path in layers:
        params = list(modules[path].parameters())
        layer_params[path] = sum(p.numel() for p in params)
        owner[path] = owner_of_param[id(params[0])] if params else ROOT
    for s in specs:
        for path in s.module_paths:
            if s.kind != ROOT:
                owner[path] = s.name

    embed = getattr(getattr(model, "encoder", None), "embed_tokens", None)
    out_proj = getattr(getattr(model, "decoder", None), "output_projection", None)
    if embed is None or out_proj is None:
        raise ValueError("the estimator models fairseq encoder-decoder models "
                         "(encoder.embed_tokens, decoder.output_projection)")
    path_of = {id(m): p for p, m in model.named_modules()}
    embed_paths = tuple(dict.fromkeys(path_of[id(m)] for m in
                                      (embed, getattr(model.decoder, "embed_tokens", embed))))
    output_paths = (path_of[id(out_proj)],)
    vocab, embed_dim = out_proj.weight.shape

    dtype, nbytes = PRECISIONS[precision]
    # meta: free; the cast and hooks stay off the caller's model. The dictionaries the encoder
    # and decoder hold (NLLB's: 256,206 symbols, a million objects to copy: 0.2 s of the
    # 0.25 s a profile took) are only read: shared, not copied
    shared = {id(v): v for m in model.modules() for v in vars(m).values()
              if isinstance(v, Dictionary)}
    traced = copy.deepcopy(model, shared)
    for module in traced.modules():
        if isinstance(module, LayerDropModuleList):
            # layerdrop skips random layers in train mode: plan for an update that skips none
            module.__class__ = nn.ModuleList
    if checkpoint_activations:
        _strip_checkpointing(traced, layers)
    raw = trace_forward(traced, list(owner) + list(embed_paths) + list(output_paths), workload,
                        dtype, features_only=chunked_loss)
    traces = {}
    for device in ("cpu", "cuda"):
        traces[device] = resolve(raw, device)
        if checkpoint_activations:
            traces[device] = _checkpointed(traces[device], layers,
                                           workload.tokens * int(embed_dim) * nbytes)
    total = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return ModelProfile(specs, owner, layer_params, embed_paths, output_paths, int(vocab),
                        int(embed_dim), total, buffers, plan, traces["cpu"], workload, nbytes,
                        traces)


def _strip_checkpointing(model: nn.Module, layers: list[str]) -> None:
    """fairseq's checkpoint_wrapper replaces a layer's forward; trace the plain forward."""
    modules = dict(model.named_modules())
    for path in layers:
        m = modules[path]
        if hasattr(m, "precheckpoint_forward"):
            m.forward = m.precheckpoint_forward


def _checkpointed(trace: ForwardTrace, layers: list[str], input_bytes: int) -> ForwardTrace:
    """With --checkpoint-activations a layer keeps only its input after forward; its full
    activations come back, one layer at a time, when backward recomputes it."""
    events, inside, kept = [], None, {}
    for kind, value in trace.events:
        if kind == "enter" and value in layers and inside is None:
            inside, kept[value] = value, 0
            events.append((kind, value))
            events.append(("act", input_bytes))
        elif kind == "exit" and value == inside:
            inside = None
            events.append((kind, value))
        elif kind == "act" and inside is not None:
            kept[inside] += value
        else:
            events.append((kind, value))
    max_act = dict(trace.max_act)
    for path, nbytes in kept.items():
        max_act[path] = max(max_act.get(path, 0), nbytes)  # recomputed in backward
    out = ForwardTrace(events, sum(v for k, v in events if k == "act"), max_act)
    out.recompute = kept  # type: ignore[attr-defined]
    return out

