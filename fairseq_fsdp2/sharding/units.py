"""The FSDP2 units a ShardingPlan describes, made with ``fully_shard`` on a device mesh
(``apply_plan``); a sub-model's direct calls routed through the root's hooks
(``route_direct_calls``); full tensors given to ``load_state_dict`` sharded; every unit kept
unsharded while ranks generate for different numbers of steps (``all_unsharded``)."""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    fully_shard, register_fsdp_forward_method)
from torch.distributed.tensor import DTensor, distribute_tensor

from . import gloo_collectives
from ..models import lora
from .plan import ShardingPlan

logger = logging.getLogger(__name__)


def apply_plan(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh, *,
               mp_policy: Optional[MixedPrecisionPolicy] = None,
               cpu_offload: bool = False) -> nn.Module:
    """Shard ``model`` in place, unit by unit (inner units first, the root last)."""
    modules = dict(model.named_modules())
    if plan.lora is not None:  # the frozen base in the compute dtype, before it is sharded
        lora.cast_frozen(model, plan.lora.frozen_dtype)
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    if cpu_offload:
        # pin_memory needs an accelerator; without one FSDP2 fails to start with it.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for unit in plan.units:
        targets = [modules[p] for p in unit.module_paths]
        fully_shard(targets if len(targets) > 1 else targets[0],
                    reshard_after_forward=unit.reshard_after_forward, **kwargs)
    shard_group = mesh.get_group("shard")
    if gloo_collectives.install(model, shard_group):
        logger.info("gloo: FSDP2 all-gathers by broadcast and reduce-scatters by all-reduce "
                    "(gloo's own collectives hold a temporary as large as their output/input)")
    model.register_load_state_dict_pre_hook(_shard_full_tensors)
    route_direct_calls(model, plan.entries)
    return model


#: the root's method names under which route_direct_calls registers each entry's forward
DIRECT_CALL_PREFIX = "fsdp2_direct_call_"


def route_direct_calls(model: nn.Module, entries) -> None:
    """Each entry module (plan.py: a module a task may call on its own), called while the root's
    forward is not running, runs inside the root unit's FSDP2 forward hooks, as a call of the
    root would: the root's parameters are gathered first (and the root lazily initialized, so
    the units inside stay non-root), resharded after as the root's setting says, gathered again
    for backward, and their gradients reduce-scattered at its end. torch's public
    ``register_fsdp_forward_method`` does it: the entry's forward is registered as a method of
    the root. Calls made inside the root's forward (and inside a routed call) run plainly."""
    depth = [0]

    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    modules = dict(model.named_modules())
    for path in entries:
        module = modules[path]
        name = DIRECT_CALL_PREFIX + "".join(c if c.isalnum() else "_" for c in path)
        plain = module.forward
        object.__setattr__(model, name, plain)  # an attribute, not a submodule
        register_fsdp_forward_method(model, name)
        module.forward = _routed(plain, getattr(model, name), depth)


def _routed(plain, through_root, depth):
    def forward(*args, **kwargs):
        if depth[0]:
            return plain(*args, **kwargs)
        depth[0] += 1
        try:
            return through_root(*args, **kwargs)
        finally:
            depth[0] -= 1
    return forward


def _shard_full_tensors(module, state_dict, prefix, *_):
    """Let ``load_state_dict`` take full tensors (fairseq's checkpoints hold full tensors):
    each is cut into this rank's shard of the matching DTensor, without communication."""
    # remove_duplicate=False: a tied weight is loaded under each of its aliases
    own = dict(module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False))
    for key, value in state_dict.items():
        target = own.get(key)
        if isinstance(target, DTensor) and not isinstance(value, DTensor):
            state_dict[key] = distribute_tensor(value.to(target.device, target.dtype), target.device_mesh,
                                                target.placements, src_data_rank=None)


@contextlib.contextmanager
def all_unsharded(model: nn.Module):
    """Every unit's parameters gathered for the duration, with no collective inside: for
    validation that generates (``--eval-bleu``), where each rank decodes its own sentences for
    its own number of steps and the per-forward all-gathers of different ranks would pair up
    wrongly and hang. Public API to gather (``unshard``, ``set_reshard_after_forward``); the
    units' own reshard settings are restored from FSDP2's private state (marked; a torch that
    renames it fails here at the first such validation, not silently)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()  # private: no public getter of the setting
        saved.append((state, state._auto_reshard_after_forward,
                      [g.post_forward_mesh_info for g in state._fsdp_param_groups]))
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for state, auto, infos in saved:
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()
