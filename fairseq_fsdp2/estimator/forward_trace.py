"""One forward pass on the meta device, as the estimator's events (see ``peak.py``): module
entries and exits, and the bytes of every tensor autograd saves.

A model's layers repeat: NLLB-3.3B's 48 make up almost all of a trace's 4,300 operators, each
run through PyTorch's Python meta kernels. A layer called as one traced before (the same
structure, inputs of the same shapes, dtypes and standing) records what the traced one did
again, under its own path, without running: its events, its largest saved tensor, and fresh
outputs of the traced one's shapes. ``replay=False`` runs every layer (the events are the same:
tests/test_estimate_rules.py compares the two).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..sharding.plan import layer_candidates


@dataclass
class ForwardTrace:
    """What one forward pass does, in order: ("enter"|"exit", module path) and ("act", bytes)."""

    events: list[tuple[str, object]]
    act_bytes: int
    max_act: dict[str, int]  # layer path -> its largest saved tensor (bytes)


@dataclass
class Workload:
    tokens: int  # tokens per rank per micro-batch (batch x seq_len)
    batch: int
    seq_len: int


class _NoPadding(TorchDispatchMode):
    """Answers the data-dependent ``.any()`` checks fairseq makes on meta tensors ("are there
    padding tokens?") with False: the estimate assumes full batches of equal-length sentences."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default,
                    torch.ops.aten.is_nonzero.default) and args[0].is_meta:
            return False
        return func(*args, **(kwargs or {}))


def _is_attention(module: nn.Module) -> bool:
    """fairseq's MultiheadAttention (and look-alikes)."""
    return all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "out_proj",
                                             "num_heads"))


class _Recorder:
    """The trace being made; while layers run, each change is also logged for replaying."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude  # storages of parameters and buffers
        self.events: list[tuple[str, object]] = []
        self.seen: dict[int, torch.Tensor] = {}
        self.max_act: dict[str, int] = {}
        self.current: list[str] = []
        self.attention: list[dict] = []
        self.logs: list[list] = []  # one per layer running (innermost last)

    def event(self, kind: str, value) -> None:
        self.events.append((kind, value))
        for log in self.logs:
            log.append(("event", kind, value))

    def largest(self, path: str, nbytes: int) -> None:
        self.max_act[path] = max(self.max_act.get(path, 0), nbytes)
        for log in self.logs:
            log.append(("max", path, nbytes))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.exclude and key not in self.seen:
            self.seen[key] = t
            nbytes = storage.nbytes()
            if self.attention and key not in self.attention[-1]["inputs"]:
                self.attention[-1]["internal"] += nbytes
            else:
                self.event("act", nbytes)
            if self.current:
                self.largest(self.current[-1], nbytes)
        return t

    def standing(self, t: torch.Tensor) -> str:
        """A tensor's storage to the trace: a parameter's, one saved already, or new."""
        key = t.untyped_storage()._cdata
        return "param" if key in self.exclude else "saved" if key in self.seen else "new"


def _plain(value) -> object:
    """A module attribute as comparable data (a layer's settings), or its type's name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return getattr(value, "__qualname__", type(value).__qualname__)


#: a module's attributes that are no setting of its forward: its parts (compared one by one),
#: and the key fairseq's attention gives each instance for incremental decoding's state (a
#: uuid; the trace passes no incremental state)
_NOT_SETTINGS = ("_parameters", "_buffers", "_modules", "_incremental_state_id")


def _structure(layer: nn.Module, hooked: set[str], path: str) -> tuple:
    """Everything of a layer that its forward can depend on, but its path: each submodule's
    type, parameters, buffers, settings and whether the trace hooks it."""
    out = []
    for name, m in layer.named_modules():
        full = f"{path}.{name}" if name else path
        out.append((name, type(m), m.training, full in hooked, _is_attention(m),
                    tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                          for n, p in m.named_parameters(recurse=False)),
                    tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False)),
                    tuple(sorted((k, _plain(v)) for k, v in vars(m).items()
                                 if k not in _NOT_SETTINGS and "hook" not in k))))
    return tuple(out)


def _flatten(tree) -> tuple[list, object]:
    """The leaves of nested tuples, lists and dicts, and the nesting (``_rebuilt`` undoes it);
    anything else is a leaf."""
    if type(tree) in (tuple, list, dict):
        values = tree.values() if isinstance(tree, dict) else tree
        parts = [_flatten(v) for v in values]
        nesting = tuple(nest for _, nest in parts)
        return ([leaf for leaves, _ in parts for leaf in leaves],
                (dict, tuple(tree), nesting) if isinstance(tree, dict) else (type(tree), nesting))
    return [tree], None


def _rebuilt(nesting, leaves):
    if nesting is None:
        return next(leaves)
    if nesting[0] is dict:
        return {k: _rebuilt(n, leaves) for k, n in zip(nesting[1], nesting[2])}
    return nesting[0](_rebuilt(n, leaves) for n in nesting[1])


def _tensors(inputs) -> list[torch.Tensor]:
    return [t for t in _flatten(inputs)[0] if isinstance(t, torch.Tensor)]


def _call_key(recorder: _Recorder, args, kwargs) -> Optional[tuple]:
    """A layer call's inputs as data: tensors by shape, layout, dtype, whether they need a
    gradient and their standing (storages shared between inputs numbered); None where an
    input is of a kind this does not describe."""
    leaves, spec = _flatten((args, kwargs))
    order: dict[int, int] = {}
    key = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            storage = order.setdefault(leaf.untyped_storage()._cdata, len(order))
            key.append((tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype,
                        leaf.device.type, leaf.requires_grad, recorder.standing(leaf), storage,
                        leaf.untyped_storage().nbytes()))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            key.append((type(leaf), leaf))
        else:
            return None
    return tuple(key)


def _fresh_outputs(output, recorder: _Recorder, inputs) -> Optional[tuple]:
    """How to make a layer's outputs anew: (tree spec, per leaf a tensor's shape, strides,
    dtype and whether it needs a gradient, or the value), or None where an output is not a
    tensor with its own new storage that its elements fill (not a view, an input or one saved
    inside the layer) or a plain value."""
    leaves, spec = _flatten(output)
    taken = {t.untyped_storage()._cdata for t in _tensors(inputs)}
    made = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key = leaf.untyped_storage()._cdata
            span = 1 + sum((n - 1) * s for n, s in zip(leaf.shape, leaf.stride()))
            if key in taken or recorder.standing(leaf) != "new" or leaf.storage_offset() or \
                    leaf.untyped_storage().nbytes() != span * leaf.element_size() or \
                    not leaf.numel():
                return None
            taken.add(key)
            made.append(("tensor", tuple(leaf.shape), leaf.stride(), leaf.dtype,
                         leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            made.append(("value", leaf))
        else:
            return None
    return spec, made


def _renamed(path: str, old: str, new: str) -> Optional[str]:
    if path == old:
        return new
    return new + path[len(old):] if path.startswith(old + ".") else None


def _replayable(log: list, path: str) -> bool:
    """Whether every module path of a layer's log lies within the layer."""
    return all(_renamed(e[1] if e[0] == "max" else e[2], path, path) is not None for e in log
               if e[0] == "max" or e[1] in ("enter", "exit"))


def _replay(recorder: _Recorder, log: list, old: str, new: str, inputs, saved: list) -> None:
    """``log`` again for the layer at path ``new``; the inputs the traced layer saved
    (``saved``: their places among its tensor inputs) are saved by this one."""
    tensors = _tensors(inputs)
    for i in saved:
        recorder.seen.setdefault(tensors[i].untyped_storage()._cdata, tensors[i])
    for entry in log:
        if entry[0] == "max":
            recorder.largest(_renamed(entry[1], old, new), entry[2])
        else:
            kind, value = entry[1], entry[2]
            recorder.event(kind, _renamed(value, old, new) if kind in ("enter", "exit")
                           else value)


def _remade(made: tuple):
    spec, leaves = made
    out = []
    for leaf in leaves:
        if leaf[0] == "value":
            out.append(leaf[1])
            continue
        t = torch.empty_strided(leaf[1], leaf[2], dtype=leaf[3], device="meta")
        # a new tensor that needs a gradient, made by an operation (not a leaf), as the
        # layer's was; clone saves nothing for backward and keeps a dense layout's strides
        out.append(t.requires_grad_().clone() if leaf[4] else t)
    return _rebuilt(spec, iter(out))


def _replaying_forward(layer: nn.Module, path: str, recorder: _Recorder, structure: tuple,
                       templates: dict):
    inner = layer.forward

    def forward(*args, **kwargs):
        call = _call_key(recorder, args, kwargs)
        key = None if call is None else (structure, call)
        if key is not None and templates.get(key) is not None:
            old, log, made, saved = templates[key]
            _replay(recorder, log, old, path, (args, kwargs), saved)
            return _remade(made)
        before = [recorder.standing(t) for t in _tensors((args, kwargs))]
        log: list = []
        recorder.logs.append(log)
        try:
            output = inner(*args, **kwargs)
        finally:
            recorder.logs.pop()
        if key is not None and key not in templates:
            made = _fresh_outputs(output, recorder, (args, kwargs))
            saved = [i for i, (t, was) in enumerate(zip(_tensors((args, kwargs)), before))
                     if recorder.standing(t) != was]
            templates[key] = (path, log, made, saved) if made is not None and \
                _replayable(log, path) else None
        return output
    return forward


def trace_forward(model: nn.Module, paths: Iterable[str], workload: Workload,
                  dtype: torch.dtype, features_only: bool, replay: bool = True) -> ForwardTrace:
    """Run the (meta) model forward once, in train mode, recording module entries and exits
    for ``paths`` and the bytes of every tensor autograd saves (each storage once; parameters
    and buffers excluded). ``replay``: a layer of ``paths`` called as one before replays it
    (module docstring).

    Inside attention modules, the tensors saved by the attention itself (not its inputs) are
    recorded as one ("attn", (traced bytes, fused bytes)) event: the trace runs PyTorch's
    reference attention, which saves the batch x heads x L x L probabilities (as CPU does);
    CUDA's fused kernels save q, k, v, the output and the log-sum-exp instead (fused bytes).
    ``resolve`` picks one of the two for a device."""
    model = model.to(dtype)
    model.train()
    modules = dict(model.named_modules())
    rec = _Recorder({t.untyped_storage()._cdata
                     for t in list(model.parameters()) + list(model.buffers())})

    def pre(path):
        def hook(module, args):
            rec.event("enter", path)
            rec.current.append(path)
        return hook

    def post(path):
        def hook(module, args, output):
            rec.event("exit", path)
            rec.current.pop()
        return hook

    def attention_pre(module, args, kwargs):
        names = ("query", "key", "value")
        given = {n: kwargs.get(n, args[i] if i < len(args) else None)
                 for i, n in enumerate(names)}
        query = given["query"]
        key = given["key"] if given["key"] is not None else query
        rec.attention.append({"inputs": {x.untyped_storage()._cdata for x in given.values()
                                         if isinstance(x, torch.Tensor)},
                              "internal": 0, "shape": (query.shape[0], key.shape[0],
                                                       query.shape[1], query.shape[2]),
                              "heads": module.num_heads, "itemsize": query.element_size()})

    def attention_post(module, args, kwargs, output):
        a = rec.attention.pop()
        tq, tk, b, d = a["shape"]
        fused = (3 * tq + 2 * tk) * b * d * a["itemsize"] + b * a["heads"] * tq * 4
        rec.event("attn", (a["internal"], fused))

    hooked = list(dict.fromkeys(paths))
    handles, wrapped, templates = [], [], {}
    for path in hooked:
        m = modules[path]
        handles.append(m.register_forward_pre_hook(pre(path)))
        handles.append(m.register_forward_hook(post(path)))
    for m in modules.values():
        if _is_attention(m):
            handles.append(m.register_forward_pre_hook(attention_pre, with_kwargs=True))
            handles.append(m.register_forward_hook(attention_post, with_kwargs=True))
    if replay:
        hooked_set = set(hooked)
        structures = {path: _structure(layer, hooked_set, path)
                      for path, layer in layer_candidates(model) if path in hooked_set}
        for path, structure in structures.items():
            layer = modules[path]
            wrapped.append((layer, layer.__dict__.get("forward")))
            layer.forward = _replaying_forward(layer, path, rec, structure, templates)
    b, n = workload.batch, workload.seq_len
    tokens = torch.full((b, n), 4, dtype=torch.long, device="meta")
    lengths = torch.full((b,), n, dtype=torch.long, device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), _NoPadding():
            model(tokens, lengths, tokens.clone(), features_only=features_only)
    finally:
        for h in handles:
            h.remove()
        for layer, forward in wrapped:
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
    return resolve(ForwardTrace(rec.events, 0, rec.max_act), "cpu", keep_attention=True)


def resolve(trace: ForwardTrace, device: str, keep_attention: bool = False) -> ForwardTrace:
    """The trace with attention events as activations of ``device`` (cpu: the reference
    attention, as traced; cuda: fused attention kernels)."""
    pick = 1 if device == "cuda" else 0
    events = [e if e[0] != "attn" or keep_attention else ("act", e[1][pick])
              for e in trace.events]
    total = sum(v if k == "act" else v[pick] for k, v in events if k in ("act", "attn"))
    out = ForwardTrace(events, total, trace.max_act)
    if hasattr(trace, "recompute"):
        out.recompute = trace.recompute  # type: ignore[attr-defined]
    return out
