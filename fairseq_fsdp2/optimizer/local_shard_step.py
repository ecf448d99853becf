"""The optimizer's elementwise work done on each rank's local shards, not through DTensor.

Why: fairseq's Adam runs about a dozen tensor operations per parameter per step, and fairseq
scales every gradient before the step (``multiply_grads``) and again when clipping. On FSDP2's
DTensor parameters each operation goes through DTensor's dispatch (sharding propagation,
wrapping the result): a fraction of a millisecond of CPU per operation, so for a model of a few
hundred parameter tensors (NLLB-600M: 509) most of a second per step, which on a GPU is longer
than the step itself, and on the tiny test models most of each update.

Why it is exact: FSDP2 shards every parameter, its gradient and (hence) the optimizer's state
the same way (``Shard(0)`` on the same mesh, the same local shape on a rank), and these
operations are elementwise. Running them on the local tensors is what DTensor's dispatch does
anyway, without the dispatch: the same aten operations on the same local tensors, bit for bit
(``tests/test_local_shards.py`` compares against the DTensor path). Only optimizers known to be
elementwise get this path (:data:`ELEMENTWISE`); any other (e.g. Adafactor, whose factored
second moment needs whole rows and columns) keeps the DTensor path.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterable, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor

#: Optimizers whose ``step`` is elementwise per parameter (module, class name).
ELEMENTWISE = frozenset({("fairseq.optim.adam", "Adam")})
#: the dtypes of the gradient shards FSDP2 may leave in 16 bits (sharding/sixteen_bit_grads.py): the
#: step widens them (row_chunk_step.py), multiply_grads leaves their factors pending
SIXTEEN_BIT_GRADS = (torch.float16, torch.bfloat16)
#: the parameter dtypes stored without a float32 master copy (settings.keeps_bf16_weights): the
#: row-chunked step (row_chunk_step.py) widens a chunk of their rows and rounds the update back
#: stochastically
SIXTEEN_BIT_WEIGHTS = (torch.bfloat16,)


@contextlib.contextmanager
def local_views(params: Iterable[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Each parameter as its local tensor (a view sharing its storage), with ``.grad`` the local
    shard of its gradient; plain tensors are given as they are. The views' ``.grad`` is
    cleared on exit (the parameters keep theirs)."""
    views: list[torch.Tensor] = []
    made: list[torch.Tensor] = []
    with torch.no_grad():
        for p in params:
            if isinstance(p, DTensor):
                view = p.to_local()
                if p.grad is not None and p.grad.dtype != view.dtype:
                    view.grad_dtype = None  # a 16-bit gradient shard (sharding/sixteen_bit_grads.py)
                view.grad = None if p.grad is None else p.grad.to_local()
                made.append(view)
                p = view
            views.append(p)
    try:
        yield views
    finally:
        for view in made:
            view.grad = None


def _as_dtensor(value, param: DTensor, view: torch.Tensor, old, given):
    """A state entry computed on ``param``'s local ``view``, as the DTensor it stands for: the
    old DTensor where the step kept the local tensor it was ``given`` (updated in place), else
    a new one over the local tensor the step made."""
    if not torch.is_tensor(value) or isinstance(value, DTensor) or value.shape != view.shape:
        return value  # the step count, scalars
    if value is given:
        return old
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


class LocalShardStep:
    """Mixin for a torch optimizer listed in :data:`ELEMENTWISE`: ``step`` sees each DTensor
    parameter as its local view (with the local gradient and state), then the state it made or
    replaced is stored back as DTensors keyed by the real parameters (what checkpoints save)."""

    def step(self, *args, **kwargs):
        groups = [group["params"] for group in self.param_groups]
        state = self.state
        all_params = [p for params in groups for p in params]
        with local_views(all_params) as views:
            local = dict(zip(map(id, all_params), views))
            self.state = defaultdict(dict)  # torch's own kind of state, keyed by the views
            given: dict[int, dict] = {}  # what each view's step started from
            for p, view in zip(all_params, views):
                if p in state:
                    given[id(view)] = {k: v.to_local() if isinstance(v, DTensor) else v
                                       for k, v in state[p].items()}
                    self.state[view] = dict(given[id(view)])
            try:
                for group in self.param_groups:
                    group["params"] = [local[id(p)] for p in group["params"]]
                return super().step(*args, **kwargs)
            finally:
                local_state = self.state
                for group, params in zip(self.param_groups, groups):
                    group["params"] = params
                self.state = state
                for p, view in zip(all_params, views):
                    if view not in local_state:
                        continue
                    if isinstance(p, DTensor):
                        old, before = state.get(p, {}), given.get(id(view), {})
                        state[p] = {k: _as_dtensor(v, p, view, old.get(k), before.get(k))
                                    for k, v in local_state[view].items()}
                    else:
                        state[p] = local_state[view]


def multiply_grads(params: Iterable[torch.Tensor], c, pending: Optional[list] = None) -> None:
    """fairseq's ``multiply_grads`` (scale every gradient by ``c``, a number or a scalar tensor)
    on the local shards, one ``_foreach_mul_`` per device and dtype as fairseq does. With
    ``pending`` (a list), 16-bit gradients are not scaled in place (that would round the
    product to 16 bits): ``c`` is appended to it, for the step and the norm to apply to the
    widened gradient (row_chunk_step.py)."""
    with local_views(params) as views:
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        deferred = False
        for view in views:
            if view.grad is None:
                continue
            if pending is not None and view.grad.dtype in SIXTEEN_BIT_GRADS:
                deferred = True
                continue
            by_kind.setdefault((view.grad.device, view.grad.dtype), []).append(view.grad)
        for (device, _), grads in by_kind.items():
            torch._foreach_mul_(grads, c.to(device) if torch.is_tensor(c) else c)
        if deferred:  # a copy: fairseq may scale its own factor in place later
            pending.append(c.detach().clone() if torch.is_tensor(c) else c)


_classes: dict[tuple[type, type], type] = {}


def mix_into(optimizer, mixin: type, optimizers: Optional[frozenset] = None) -> bool:
    """Give ``optimizer`` (a torch optimizer, or fairseq's around one) the ``mixin`` if its
    class is among ``optimizers`` (module, class name; None: any); returns whether it has it.
    The class becomes a subclass of the same name (as ``fully_shard`` changes a module's class;
    the name is what fairseq and torch show, and fairseq's load_checkpoint refuses a saved
    optimizer state whose optimizer_name is not the optimizer's class name). The one way the
    step's parts are mixed in (build.py composes them)."""
    cls = type(optimizer)
    if issubclass(cls, mixin):
        return True
    if optimizers is not None and (cls.__module__, cls.__name__) not in optimizers:
        return False
    if (mixin, cls) not in _classes:
        _classes[mixin, cls] = type(cls.__name__, (mixin, cls), {
            "__qualname__": cls.__qualname__, "__module__": cls.__module__})
    optimizer.__class__ = _classes[mixin, cls]
    return True


def use_local_shards(torch_optimizer: torch.optim.Optimizer) -> bool:
    """Give ``torch_optimizer`` the local-shard step if it is elementwise; returns whether it
    did."""
    return mix_into(torch_optimizer, LocalShardStep, ELEMENTWISE)
