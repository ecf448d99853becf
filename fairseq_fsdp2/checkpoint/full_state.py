"""Loading full (unsharded) state, as stock fairseq checkpoints hold it, into an FSDP2-sharded
model and optimizer: each tensor is cut into this rank's shard.
(Full model tensors passed to ``load_state_dict`` are handled by ``units.apply_plan``'s hook.)
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from ..errors import CheckpointError
from ..optimizer.adafactor_state import state_placements
from ..sharding.mesh import comm_device


def install_optimizer_hooks(torch_optimizer: torch.optim.Optimizer) -> None:
    """Let the optimizer load full (unsharded) state, e.g. from a stock DDP checkpoint."""
    torch_optimizer.register_load_state_dict_pre_hook(_shard_state)


def _shard_state(optimizer, state_dict):
    if "state" not in state_dict:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def shard(name, value, target):
        if not isinstance(target, DTensor) or not torch.is_tensor(value) \
                or isinstance(value, DTensor):
            return value
        # like the parameter, or one of Adafactor's row and column means of it
        placements = target.placements if value.shape == target.shape \
            else state_placements(name, value, target)
        if placements is None:
            return value  # e.g. a step count, a scalar
        return distribute_tensor(value.to(target.device, target.dtype), target.device_mesh,
                                 placements, src_data_rank=None)

    # torch's own format keys state by parameter index (DCP's own loads use names: left alone)
    state_dict["state"] = {
        index: {name: shard(name, value, params[index]) for name, value in per_param.items()}
        if isinstance(index, int) else per_param
        for index, per_param in state_dict["state"].items()}
    return state_dict


def broadcast_full_model(model: torch.nn.Module, full: Optional[Mapping], describe: str,
                         problem: Optional[str] = None, skip=lambda key: False) -> None:
    """Fill a sharded model from a full state dict held by rank 0 only (``full`` is None on
    the other ranks), one tensor at a time: each rank receives the tensor, keeps its shard
    and frees the rest, so no rank but 0 ever holds the full model. ``full`` may be any
    mapping, e.g. lazy views of a memory-mapped file. ``describe`` names the source in
    errors; ``problem``: rank 0 could not read it (raised on every rank); ``skip``: keys of the
    model the source does not hold and that are left as they are (LoRA's adapters)."""
    own, seen = {}, set()
    for key, target in model.state_dict(keep_vars=True).items():  # persistent state only
        if id(target) not in seen and not skip(key):  # a tied weight once, by its first name
            seen.add(id(target))
            own[key] = target
    problem = [problem]
    if dist.get_rank() == 0 and problem[0] is None:
        missing = sorted(set(own) - set(full))
        wrong = sorted(k for k in set(own) & set(full) if tuple(full[k].shape) != tuple(own[k].shape))
        if missing or wrong:
            problem[0] = (f"{describe} does not fit this model: " + "; ".join(
                [f"{k} not in checkpoint" for k in missing[:3]] +
                [f"{k} checkpoint {tuple(full[k].shape)} vs model {tuple(own[k].shape)}"
                 for k in wrong[:3]]))
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise CheckpointError(problem[0])
    # Broadcast on the device the group's backend moves (NCCL: CUDA, even when --cpu-offload
    # keeps the shards on the CPU), then copy into the shard wherever it lives.
    device = comm_device()
    with torch.no_grad():
        for key, target in own.items():
            if dist.get_rank() == 0:
                value = full[key].to(device, target.dtype).contiguous()
            else:
                value = torch.empty(target.shape, dtype=target.dtype, device=device)
            dist.broadcast(value, src=0)
            copy_into_shard(target, value)
            del value


def copy_full_state(own: Mapping[str, torch.Tensor], full: Mapping) -> list[str]:
    """Copy full tensors that every rank holds (e.g. a stock checkpoint fairseq broadcast
    whole) into the sharded tensors of the same names, each rank its own shard. Returns the
    names ``full`` lacks, whose tensors are left as they were."""
    missing = []
    with torch.no_grad():
        for key, target in own.items():
            if key not in full:
                missing.append(key)
                continue
            value = full[key]
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(f"{key}: checkpoint {tuple(value.shape)} vs model "
                                      f"{tuple(target.shape)}")
            copy_into_shard(target, value.to(target.device, target.dtype))
    return missing


def copy_into_shard(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full tensor that every rank holds into ``target``: its own shard of a DTensor
    (cut locally, no communication), or the whole of a plain tensor. ``copy_`` crosses
    devices (an offloaded shard: to the CPU)."""
    if isinstance(target, DTensor):
        value = distribute_tensor(value, target.device_mesh, target.placements,
                                  src_data_rank=None)
    target.copy_(value)
