"""Loading full (unsharded) optimizer state, as stock fairseq checkpoints hold it, into
FSDP2-sharded parameters: each tensor is cut into this rank's shard, without communication.
(The model's full tensors are handled by the pre-hook ``apply.apply_plan`` installs.)
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def install_optimizer_hooks(torch_optimizer: torch.optim.Optimizer) -> None:
    """Let the optimizer load full (unsharded) state, e.g. from a stock DDP checkpoint."""
    torch_optimizer.register_load_state_dict_pre_hook(_shard_state)


def _shard_state(optimizer, state_dict):
    if "state" not in state_dict:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def shard(value, target):
        if isinstance(target, DTensor) and torch.is_tensor(value) \
                and not isinstance(value, DTensor) and value.shape == target.shape:
            return distribute_tensor(value.to(target.device, target.dtype), target.device_mesh,
                                     target.placements, src_data_rank=None)
        return value

    # torch's own format keys state by parameter index (DCP's own loads use names: left alone)
    state_dict["state"] = {
        index: {name: shard(value, params[index]) for name, value in per_param.items()}
        if isinstance(index, int) else per_param
        for index, per_param in state_dict["state"].items()}
    return state_dict
