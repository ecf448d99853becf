"""The device mesh the model is sharded over, the device its collectives move, and a sharded
tensor's part on this rank."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor


def build_mesh(device_type: str, world_size: int, replicate_degree: int = 1) -> DeviceMesh:
    """1-D mesh for FSDP, or a (replicate, shard) 2-D mesh for HSDP when replicate_degree > 1."""
    if replicate_degree > 1:
        return init_device_mesh(device_type, (replicate_degree, world_size // replicate_degree),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a tensor must be for a collective over ``group``: NCCL moves CUDA tensors only
    (the current CUDA device, which fairseq sets per rank), gloo moves CPU tensors. A group
    with a CPU backend besides NCCL (``cpu:gloo,cuda:nccl``) takes CPU tensors too."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "cpu:" not in backend:
        return torch.device("cuda")
    return torch.device("cpu")


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a view: in-place changes reach the DTensor); a
    plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
