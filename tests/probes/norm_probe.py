"""One rank of the gradient-norm and full-state broadcast checks (tests/test_gpu_logic.py), on
gloo. Prints one ``PROBE {json}`` line.

For each of plain sharding and CPU offload: a small model (rows that do not divide evenly over
2 ranks) is sharded with FSDP2 and trained one backward on the same batch on every rank, next to
an unsharded copy. Apex is emulated (no GPU here, so apex cannot be installed): fairseq's helper
is told apex's ``multi_tensor_total_norm`` is available and given a stand-in that, like apex's
kernel, sees each gradient's local tensor. The plugin's optimizer must give the unsharded norm
and clip like the unsharded model; fairseq's helper, under that emulation, does not.
Then a full state dict held by rank 0 is broadcast into the sharded model.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from fairseq import utils as fairseq_utils
from fairseq.optim.adam import FairseqAdamConfig
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from probe_report import report_and_exit

from fairseq_fsdp2.optimizer.build import build_optimizer
from fairseq_fsdp2.checkpoint.full_state import broadcast_full_model

MAX_NORM = 0.5


def emulated_apex_total_norm(grads):
    """What apex's multi_tensor_l2norm computes over the tensors it is handed: the local
    shards of DTensor gradients (this rank's part only)."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    return torch.norm(torch.stack([torch.norm(t.float()) for t in local]))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def cfg():
    adam = OmegaConf.structured(FairseqAdamConfig(_name="adam", lr=[1e-3], tpu=False))
    return OmegaConf.create({"common": {"fp16": False}, "optimizer": adam})


def check(offload: bool, mesh) -> dict:
    reference, sharded = model(), model()
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(sharded, mesh=mesh, **policy)
    torch.manual_seed(1)
    batch = torch.randn(7, 6) * 10  # the same on every rank: FSDP2's mean is the batch's grad
    for m in (reference, sharded):
        m(batch).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)

    params = list(sharded.parameters())
    optimizer = build_optimizer(cfg(), params)
    fairseq_norm = fairseq_utils.clip_grad_norm_(params, 0)  # apex emulated: local shards
    if isinstance(fairseq_norm, DTensor):
        fairseq_norm = fairseq_norm.full_tensor()
    # torch's own DTensor path, what the plugin's shorter way must equal (optimizer/grad_norm.py)
    through_dtensor = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = optimizer.clip_grad_norm(MAX_NORM)
    clipped = [p.grad.full_tensor() for p in params]
    return {"expected": expected.item(), "norm": norm.item(), "norm_is_dtensor":
            isinstance(norm, DTensor), "fairseq_norm": float(fairseq_norm),
            "dtensor_norm": through_dtensor.full_tensor().item(),
            "dtensor_norm_placements": [str(p) for p in through_dtensor.placements],
            "offload_policies": offload_policies(sharded),
            "clipped_max_diff": max((c - r.grad).abs().max().item()
                                    for c, r in zip(clipped, reference.parameters())),
            "optimizer": type(optimizer.optimizer).__module__,
            "broadcast_max_diff": broadcast(sharded)}


def offload_policies(sharded: nn.Module) -> list[str]:
    """The offload policy each FSDP2 unit was sharded with. On a CPU-only machine shards,
    gradients and compute are all on the CPU either way, so the devices cannot show that the
    offload case ran FSDP2's offload paths; its units' policy can. Private torch API
    (``_get_fsdp_state``, ``_fsdp_param_group``: FSDP2 has no public getter for the policy,
    torch 2.13): a torch that renames them fails this probe, loudly."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in sharded.modules()
              if hasattr(m, "_get_fsdp_state")]
    # (a unit with no parameters of its own, here the root, has no group)
    assert any(g is not None for g in groups)
    return sorted({type(g.offload_policy).__name__ for g in groups if g is not None})


def broadcast(sharded: nn.Module) -> float:
    """Fill the sharded model from another model's full state held by rank 0 only."""
    torch.manual_seed(2)
    source = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    full = copy.deepcopy(source.state_dict()) if dist.get_rank() == 0 else None
    broadcast_full_model(sharded, full, "probe")
    got = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    return max((got[k] - v).abs().max().item() for k, v in source.state_dict().items())


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fairseq_utils.multi_tensor_l2norm_available = True
    fairseq_utils.multi_tensor_total_norm = emulated_apex_total_norm
    report = {"plain": check(False, mesh), "offload": check(True, mesh)}
    report_and_exit(report)


if __name__ == "__main__":
    main()
