"""One rank of tests/test_narrow_grads.py's check of FSDP2's private state
(sharding/sixteen_bit_grads.py), on gloo with the plugin's collectives. Prints one ``PROBE {json}``.

Two copies of a small model (rows that do not divide evenly over 2 ranks) sharded alike with a
bf16 compute and reduce dtype; one keeps its gradient shards in the reduce dtype. The same
batch, one forward and backward on each: the kept gradients must be bf16 DTensors laid out as
their parameters, equal to FSDP2's fp32 shards of the other copy (which are the same bf16
values widened). Two forwards: the setting survives FSDP2's lazy initialization."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from probe_report import report_and_exit

from fairseq_fsdp2.sharding import gloo_collectives
from fairseq_fsdp2.sharding.sixteen_bit_grads import keep_reduce_dtype_grads


def sharded(mesh, keep: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    gloo_collectives.install(model, mesh.get_group())
    groups = keep_reduce_dtype_grads(model) if keep else 0
    return model, groups


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    (narrow, groups), (wide, _) = sharded(mesh, True), sharded(mesh, False)
    torch.manual_seed(1)
    report = {"groups": groups, "dtypes": [], "wide_dtypes": [], "equal": [], "dtensor": []}
    for step in range(2):
        batch = torch.randn(7, 6) * 10
        for m in (narrow, wide):
            for p in m.parameters():
                p.grad = None
            m(batch).float().square().sum().backward()
        for p, q in zip(narrow.parameters(), wide.parameters()):
            report["dtypes"].append(str(p.grad.dtype))
            report["wide_dtypes"].append(str(q.grad.dtype))
            report["dtensor"].append(isinstance(p.grad, DTensor) and
                                     p.grad.placements == p.placements)
            report["equal"].append(torch.equal(p.grad.to_local().float(), q.grad.to_local()))
    report_and_exit(report)


if __name__ == "__main__":
    main()
