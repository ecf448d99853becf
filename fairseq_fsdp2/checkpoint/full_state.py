"""Full (unsharded) state in fairseq's checkpoint format, from and to FSDP2-sharded state.

fairseq saves ``model.state_dict()`` and ``optimizer.state_dict()`` from rank 0 and loads them by
broadcasting the whole file. With FSDP2 those hold DTensor shards, so:
- the model's full state dict is gathered to rank 0 (CPU) for saving;
- optimizer state tensors are gathered on save and cut back into shards on load, through the
  optimizer's public state-dict hooks, so the saved file is world-size independent;
- loading model tensors is handled by the pre-hook that ``apply.apply_plan`` installs.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor


def full_model_state_dict(model: nn.Module) -> dict:
    """All ranks call; rank 0 gets the full CPU state dict, the others an empty one."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    # get_model_state_dict drops aliases of tied weights; fairseq's format keeps every key.
    if state:
        for key, param in model.named_parameters(remove_duplicate=False):
            if key not in state:
                canonical = _alias_of(model, param)
                state[key] = state[canonical]
    return state


def _alias_of(model: nn.Module, param: torch.Tensor) -> str:
    for key, p in model.named_parameters():
        if p is param:
            return key
    raise KeyError("parameter not found in model")


def install_optimizer_hooks(torch_optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's state dict hold full tensors (save) and accept them (load)."""
    torch_optimizer.register_state_dict_post_hook(_gather_state)
    torch_optimizer.register_load_state_dict_pre_hook(_shard_state)


def _gather_state(optimizer, state_dict):
    # New dicts: torch's state_dict() shares the per-parameter dicts with the live state.
    state_dict["state"] = {
        index: {name: value.full_tensor().cpu() if isinstance(value, DTensor) else value
                for name, value in per_param.items()}
        for index, per_param in state_dict["state"].items()}
    return state_dict


def _shard_state(optimizer, state_dict):
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def shard(value, target):
        if isinstance(target, DTensor) and torch.is_tensor(value) \
                and not isinstance(value, DTensor) and value.shape == target.shape:
            return distribute_tensor(value.to(target.device, target.dtype), target.device_mesh,
                                     target.placements, src_data_rank=None)
        return value

    state_dict["state"] = {
        index: {name: shard(value, params[int(index)]) for name, value in per_param.items()}
        for index, per_param in state_dict["state"].items()}
    return state_dict
