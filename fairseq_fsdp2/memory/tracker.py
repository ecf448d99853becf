"""The tracker behind ``--fsdp2-memory-breakdown N`` (breakdown.py runs it and reports).

Imported only for the chosen update: ``torch.distributed._tools`` imports TorchDynamo and
Inductor (about 2.5 s on 2 cores), which every other run must not pay at start.

Why our own tracker: PyTorch's ``FSDPMemTracker`` swaps FSDP2's forward hooks module by module
and leaves stale ones behind with grouped units (``fully_shard([a, b, c])``, which the shared
embedding always is here); the next forward then fails. This tracker never touches FSDP2's
hooks. It is a ``torch.distributed._tools.mem_tracker.MemTracker`` (storage bookkeeping, frees
through weak references, ``UntypedStorage.resize_`` tracking, module and backward tracking)
that classifies storages from what it sees:

============================  =================================================================
sharded params                local shards of FSDP2's DTensor parameters
gathered params               the unsharded parameters: the all-gather outputs FSDP2 copies into
                              (``fsdp.split_with_sizes_copy``); FSDP2 allocates and frees them
                              with ``resize_``, which the tracker follows
grads before reduce-scatter   full-size weight gradients: gradients accumulated into an unsharded
                              parameter's ``.grad``, each use's own weight gradient computed in
                              backward (an output shaped like a gathered parameter of the
                              innermost module that is not computed from that parameter), and
                              FSDP2's reduce-scatter inputs list (``fsdp.chunk_cat``)
sharded grads                 reduce-scatter outputs and the sharded parameters' ``.grad``
optimizer state               the optimizer's ``state`` tensors
activations                   allocated in forward (or recomputed) inside a module, except:
logits/loss                   allocated inside the output projection (forward and backward) or in
                              the criterion outside the model (log-softmax, loss, their gradients)
comm buffers                  all-gather buffers (``fsdp.all_gather_copy_in`` outputs) and
                              reduce-scatter buffers (``fsdp.chunk_cat`` output, reduce-scatter
                              input)
other                         everything else: backward temporaries (activation gradients),
                              optimizer-step and clipping temporaries, buffers
============================  =================================================================

Only tensors allocated or tagged inside the tracked update count: the batch and anything the
process holds outside the model/optimizer (fairseq's data, Python, libraries) do not, so the
tracked peak is below the process's resident peak (``memory.jsonl``).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _RefType, _UpdateType, MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map_only

logger = logging.getLogger(__name__)

TOP_MODULES = 5
_TOTAL = "Total"  # MemTracker's key for a device's total


class Category(_RefType):
    """What a storage is used for (the rows of the table, in this order)."""

    SHARDED = "sharded params"
    GATHERED = "gathered params"
    GRAD_UNSHARDED = "grads before reduce-scatter"
    GRAD_SHARDED = "sharded grads"
    OPTIMIZER = "optimizer state"
    ACTIVATIONS = "activations"
    LOGITS = "logits/loss"
    COMM = "comm buffers"
    OTHER = "other"


#: Categories whose bytes are attributed to the module that allocated them.
ATTRIBUTED = frozenset({Category.GRAD_UNSHARDED, Category.ACTIVATIONS, Category.LOGITS,
                        Category.OTHER})


def _fsdp_op(name: str):
    """An FSDP2 custom op (``torch.ops.fsdp.NAME``), or None where this torch has none."""
    packet = getattr(torch.ops.fsdp, name, None)
    return getattr(packet, "default", None)


class BreakdownTracker(MemTracker):
    """Tracks one update of a model sharded with FSDP2 (grouped units included).

    Use as a context manager around the whole update (forward, backward, optimizer step), then
    read ``result()``. One instance per update.
    """

    def __init__(self, model: nn.Module, criterion: Optional[nn.Module],
                 optimizer: Optional[torch.optim.Optimizer], device: torch.device) -> None:
        super().__init__()
        self._ref_class = Category
        self._model = model
        self._criterion = criterion
        self._optimizer = optimizer
        self._device_type = device.type
        self._names = _module_names(model, criterion)
        self._projections = [m for name, m in model.named_modules()
                             if name.rsplit(".", 1)[-1] == "output_projection"]
        self._fw_stack: list[nn.Module] = []  # modules running forward (or recomputing)
        self._bw_active: list[nn.Module] = []  # modules whose backward has started, in order
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._owner: Optional[str] = None  # the module charged for the op being tracked
        self._recording = False
        self._by_module: dict[str, int] = defaultdict(int)
        self._max = {c: 0 for c in Category}
        self._max_by_phase: dict[str, dict[Category, int]] = {}
        self._peak = -1
        self._at_peak = {c: 0 for c in Category}
        self._modules_at_peak: dict[str, int] = {}
        self._module_max: dict[str, int] = defaultdict(int)
        self._peak_where = ("", "")  # (phase, innermost module) at the peak
        self._ops = {_fsdp_op("all_gather_copy_in"): self._all_gather_copy_in,
                     _fsdp_op("split_with_sizes_copy"): self._split_with_sizes_copy,
                     _fsdp_op("chunk_cat"): self._chunk_cat,
                     torch.ops.c10d._reduce_scatter_base_.default: self._reduce_scatter}
        self._ops.pop(None, None)

    # -- entry and exit ------------------------------------------------------------------------
    def __enter__(self) -> "BreakdownTracker":
        self._tag_existing()
        super().__enter__()
        self._recording = True
        self._observe()
        return self

    def __exit__(self, *args: Any) -> None:
        self._recording = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        super().__exit__(*args)
        self._WINFO.clear()  # drop the weak references: frees after this no longer count

    def _tag_existing(self) -> None:
        """Tag what exists before the update: shards, gathered params, grads, optimizer state."""
        seen: set[int] = set()
        for module in self._model.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group  # one per unit, grouped or not
            if group is None or id(group) in seen:
                continue
            seen.add(id(group))
            for fsdp_param in group.fsdp_params:
                sharded = fsdp_param.sharded_param
                self._update_and_maybe_create_winfos(sharded, Category.SHARDED)
                if sharded.grad is not None:
                    self._update_and_maybe_create_winfos(sharded.grad, Category.GRAD_SHARDED)
                # FSDP2 runs the post-accumulate-grad hooks of a sharded parameter after it
                # writes (or adds to) its sharded gradient.
                self._handles.append(sharded.register_post_accumulate_grad_hook(
                    partial(self._tag_grad, Category.GRAD_SHARDED)))
                for out in getattr(fsdp_param, "all_gather_outputs", None) or ():
                    self._update_and_maybe_create_winfos(out, Category.GATHERED)
        for p in self._model.parameters():  # parameters FSDP2 does not manage, if any
            if not isinstance(p, DTensor) and get_untyped_storages(p) and \
                    not any(st in self._WINFO for st in get_untyped_storages(p)):
                self._update_and_maybe_create_winfos(p, Category.GATHERED)
        for b in self._model.buffers():
            self._update_and_maybe_create_winfos(b, Category.OTHER)
        if self._optimizer is not None:
            self._track_optimizer_states(Category.OPTIMIZER, self._optimizer)

    def _tag_grad(self, category: Category, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._update_and_maybe_create_winfos(param.grad, category)

    def _track_optimizer_states(self, reftype: _RefType, optimizer: torch.optim.Optimizer) -> None:
        # MemTracker's optimizer step hooks call this with its own category
        super()._track_optimizer_states(Category.OPTIMIZER, optimizer)

    # -- module tracking (MemTracker's user hooks, replaced) -----------------------------------
    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if not self._mod_tracker.is_bw and not self._fw_stack:
            self._bw_active.clear()  # a new forward: the previous backward is over
        self._fw_stack.append(module)

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if self._fw_stack and self._fw_stack[-1] is module:
            self._fw_stack.pop()
        # During forward the module holds its unsharded parameters (FSDP2's own post-forward
        # hook, which may reshard, runs after this global one): tag their gradients when
        # autograd accumulates them.
        for p in module._parameters.values():
            if p is not None and p.requires_grad and not isinstance(p, DTensor) \
                    and id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(
                    partial(self._tag_grad, Category.GRAD_UNSHARDED)))

    def _pre_bw_hook(self, module: Optional[nn.Module], grad_outputs: Any) -> None:
        if module is not None:
            self._bw_active.append(module)

    def _post_bw_hook(self, module: Optional[nn.Module], grad_inputs: Any) -> None:
        for i in range(len(self._bw_active) - 1, -1, -1):
            if self._bw_active[i] is module:
                del self._bw_active[i]
                break

    def _innermost(self) -> Optional[nn.Module]:
        if self._fw_stack:
            return self._fw_stack[-1]
        if self._mod_tracker.is_bw and self._bw_active:
            return self._bw_active[-1]
        return None

    def _phase(self) -> str:
        if self._in_opt:
            return "optimizer step"
        if self._mod_tracker.is_bw:
            return "backward"
        return "forward" if self._fw_stack else "other"

    def _in_logits_region(self) -> bool:
        stack = self._fw_stack or (self._bw_active if self._mod_tracker.is_bw else [])
        if any(m is p for m in stack for p in self._projections):
            return True
        return (self._criterion is not None and any(m is self._criterion for m in stack)
                and not any(m is self._model for m in stack))

    def _new_category(self) -> Category:
        if self._in_opt:
            return Category.OTHER  # step temporaries; the state is re-tagged after the step
        if self._in_logits_region():
            return Category.LOGITS
        return Category.ACTIVATIONS if self._fw_stack else Category.OTHER

    # -- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if active_fake_mode() is not None:
            return out  # shape propagation, no real memory
        module = self._innermost()
        self._owner = self._names.get(id(module)) if module is not None else None
        category = self._new_category()
        weight_grad_candidates = self._gathered_params(module) \
            if self._mod_tracker.is_bw and module is not None else ()
        tree_map_only(torch.Tensor,
                      partial(self._track_output, category, weight_grad_candidates, args), out)
        retag = self._ops.get(func)
        if retag is not None:
            retag(args, kwargs, out)
        self._owner = None
        return out

    @staticmethod
    def _gathered_params(module: nn.Module) -> list[torch.Tensor]:
        return [p for p in module._parameters.values()
                if p is not None and not isinstance(p, DTensor)]

    def _track_output(self, category: Category, params: list[torch.Tensor], args: Any,
                      t: torch.Tensor) -> None:
        for p in params:  # backward only: a weight gradient of the innermost module?
            if t.shape == p.shape and t.dtype == p.dtype and not _uses_storage(args, p):
                category = Category.GRAD_UNSHARDED
                break
        self._track(category, t)

    def _retag(self, tensors: Any, category: Category) -> None:
        flat, _ = tree_flatten(tensors)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._update_and_maybe_create_winfos(t, category)

    def _all_gather_copy_in(self, args, kwargs, out) -> None:
        self._retag(out, Category.COMM)

    def _split_with_sizes_copy(self, args, kwargs, out) -> None:
        self._retag(kwargs.get("out"), Category.GATHERED)

    def _chunk_cat(self, args, kwargs, out) -> None:
        self._retag(args[0], Category.GRAD_UNSHARDED)
        self._retag(kwargs.get("out"), Category.COMM)

    def _reduce_scatter(self, args, kwargs, out) -> None:
        self._retag(args[1], Category.COMM)
        self._retag(args[0], Category.GRAD_SHARDED)

    # -- accounting ----------------------------------------------------------------------------
    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if not self._recording:
            return
        owner = getattr(winfo, "owner", None)
        if u_type == _UpdateType.ADD:
            owner = winfo.owner = self._owner if winfo.reftype in ATTRIBUTED else None
            change = winfo.mem_consumed
        elif u_type == _UpdateType.DEL:
            change = -winfo.mem_consumed
        elif u_type == _UpdateType.SIZE:
            change = winfo.mem_consumed - old_mem_consumed
        else:  # REF: a new category; stop charging the module if it is no longer its own
            change = 0
            if owner is not None and winfo.reftype not in ATTRIBUTED:
                change, winfo.owner = -winfo.mem_consumed, None
        if owner is not None and change:
            self._by_module[owner] += change
            if self._by_module[owner] > self._module_max[owner]:
                self._module_max[owner] = self._by_module[owner]
        self._observe()

    def _observe(self) -> None:
        snap = next((s for d, s in self._curr_mem_snap.items() if d.type == self._device_type),
                    None)
        if snap is None:
            return
        phase_max = self._max_by_phase.setdefault(self._phase(), {c: 0 for c in Category})
        for c in Category:
            if snap[c] > self._max[c]:
                self._max[c] = snap[c]
            if snap[c] > phase_max[c]:
                phase_max[c] = snap[c]
        if snap[_TOTAL] > self._peak:
            self._peak = snap[_TOTAL]
            self._at_peak = {c: snap[c] for c in Category}
            self._modules_at_peak = {k: v for k, v in self._by_module.items() if v > 0}
            module = self._innermost()
            self._peak_where = (self._phase(),
                                self._names.get(id(module), "") if module is not None else "")

    def result(self) -> dict:
        """This rank's record (bytes), JSON-serialisable."""
        top = sorted(self._modules_at_peak.items(), key=lambda kv: -kv[1])[:TOP_MODULES]
        return {"peak_bytes": max(self._peak, 0),
                "peak_phase": self._peak_where[0], "peak_module": self._peak_where[1],
                "at_peak": {c.value: self._at_peak[c] for c in Category},
                "max": {c.value: self._max[c] for c in Category},
                "max_by_phase": {phase: {c.value: v[c] for c in Category}
                                 for phase, v in self._max_by_phase.items()},
                "top_modules": [{"module": name, "at_peak": b,
                                 "max": self._module_max[name]} for name, b in top]}


def _uses_storage(args: Any, param: torch.Tensor) -> bool:
    """Whether any tensor in ``args`` shares ``param``'s storage (then the op computes an
    activation gradient from the weight, not the weight's gradient)."""
    ptr = param.untyped_storage().data_ptr()
    flat, _ = tree_flatten(args)
    return any(isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
               and a.untyped_storage().data_ptr() == ptr for a in flat)


def _module_names(model: nn.Module, criterion: Optional[nn.Module]) -> dict[int, str]:
    """id(module) -> its path; a module reachable under several paths (the shared embedding)
    is named by all of them, joined with '='."""
    paths: dict[int, list[str]] = defaultdict(list)
    for path, module in model.named_modules(remove_duplicate=False):
        paths[id(module)].append(path or "model")
    names = {k: "=".join(v) for k, v in paths.items()}
    if criterion is not None:
        names[id(criterion)] = "criterion"
    return names


def torch_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer inside fairseq's wrappers (FP16 optimizer -> FairseqOptimizer -> ...)."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer) or optimizer is None:
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None
