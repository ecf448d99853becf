"""One rank of the gloo collectives check (tests/test_gloo_comms.py), run on 4 ranks. Prints one
``PROBE {json}``: ``{"4": report, "2": report}``, the checks below on all 4 ranks, then on a
2-rank group of ranks 0 and 1 (its own gloo context of 2: the same algorithms as a 2-process
world, two processes fewer) while ranks 2 and 3 wait.

1. The collectives alone, against gloo's own on the same inputs: all-gather outputs compared
   bit for bit; each reduce-scatter output element's difference, as a multiple of
   gamma(n - 1) x (the sum of its n terms' magnitudes) (see ``collectives``); and the resident
   memory each adds (VmHWM reset before, read after; outputs allocated and written beforehand,
   so only temporaries count), at 8 MiB and 2 MiB shards (what grows with the data is the
   difference).
2. Through FSDP2: two copies of one model, sharded alike (uneven rows, a unit per layer and a
   root), trained 3 Adam steps on the same batches, one with FSDP2's collectives and one after
   ``gloo_collectives.install``; every parameter compared bit for bit; and how often FSDP2 called the
   installed collectives (torch calls them through an interface this module only imitates).
   Only ranks 0 and 1 contribute gradients (the others' losses are multiplied by 0): every
   gradient sum then has at most two non-zero terms, which float addition sums to the same
   bits in any association, so the runs must be equal at any world size (how the collectives
   associate more terms is what part 1 bounds).
3. The same with 16-bit gradient reduction (``--fsdp2-reduce-dtype``): FSDP2's
   ``MixedPrecisionPolicy(param_dtype=reduce_dtype=fp16 or bf16)``, whose reduce-scatter input
   is in that dtype (fp16: pre- and post-divided, a SUM; bf16: an AVG): the installed
   collectives give the same bits as FSDP2's own, and the input they get is in that dtype.
4. What the fp16 reduction computes, against stock fairseq's legacy_ddp on the same local fp16
   gradients (its ``LegacyDistributedDataParallel.all_reduce_grads`` itself, not a copy: each
   gradient divided by the world size in fp16, then all-reduced in fp16):
   FSDP2's sharded gradient with reduce dtype fp16, and with fp32 (the default), compared bit
   for bit; and a gradient of 40,000 per rank (finite in fp16, as is its mean), reduced by
   FSDP2 in fp16 and by legacy_ddp's code: which of the two overflows.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from fairseq.distributed.legacy_distributed_data_parallel import LegacyDistributedDataParallel
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from probe_report import report_and_exit

from fairseq_fsdp2.sharding import gloo_collectives

MIB = 2 ** 20
U32 = 2.0 ** -24  # float32 unit roundoff


def gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): a float32 sum of k + 1 terms, in any association, is
    within gamma_k x (the sum of the terms' magnitudes) of the exact sum."""
    return k * U32 / (1 - k * U32)


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def extra_memory(run, group) -> int:
    """Resident bytes ``run`` adds on this rank (writing 5 to clear_refs resets VmHWM)."""
    dist.barrier(group=group)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = hwm_bytes()
    run()
    extra = hwm_bytes() - before
    dist.barrier(group=group)
    return extra


def collectives(group, numel: int) -> dict:
    size, rank = group.size(), group.rank()
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn(numel, generator=g)
    ours, theirs = torch.zeros(numel * size), torch.zeros(numel * size)
    ours[rank * numel:(rank + 1) * numel].copy_(shard)
    slot = ours[rank * numel:(rank + 1) * numel]
    ag_ours = extra_memory(lambda: gloo_collectives.BroadcastAllGather()(ours, slot, group), group)
    ag_theirs = extra_memory(lambda: dist.all_gather_into_tensor(theirs, shard, group=group),
                             group)
    grads = torch.randn(numel * size, generator=g)
    mine, out_ours, out_theirs = grads.clone(), torch.zeros(numel), torch.zeros(numel)
    rs_ours = extra_memory(lambda: gloo_collectives.AllReduceReduceScatter()(
        out_ours, mine, group, dist.ReduceOp.SUM), group)
    rs_theirs = extra_memory(lambda: dist.reduce_scatter_tensor(out_theirs, grads, group=group),
                             group)
    # each output element sums the ranks' n terms; both results are within gamma(n - 1) x
    # their magnitudes' sum of the exact sum, so within twice that of each other. The
    # magnitudes summed in float64 (4 float32 terms: exact); the worst element's difference
    # in units of gamma(n - 1) x that sum, the largest over the ranks' chunks
    magnitude = grads.abs().double()
    dist.all_reduce(magnitude, group=group)
    scale = gamma(size - 1) * magnitude[rank * numel:(rank + 1) * numel]
    diff = (out_ours - out_theirs).abs().double()
    ratio = torch.where(diff > 0, diff / scale.clamp_min(1e-300), torch.zeros_like(diff)).max()
    dist.all_reduce(ratio, op=dist.ReduceOp.MAX, group=group)
    return {"bytes": numel * 4, "all_gather_equal": torch.equal(ours, theirs),
            "reduce_scatter_max_diff": (out_ours - out_theirs).abs().max().item(),
            "reduce_scatter_diff_in_gamma_sums": ratio.item(),
            "extra": {"all_gather": [ag_ours, ag_theirs],
                      "reduce_scatter": [rs_ours, rs_theirs]}}


class Counting:
    """Counts the calls FSDP2 makes to the installed collectives."""

    def __init__(self, comm):
        self.comm, self.calls, self.dtypes = comm, 0, set()

    def allocate(self, *args, **kwargs):
        return self.comm.allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        tensor = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        self.dtypes.add(str(tensor.dtype).removeprefix("torch."))
        return self.comm(*args, **kwargs)


def build_model() -> nn.Module:
    """The probe's model, the same initial weights at every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(),
                         nn.Linear(5, 3))


def train(mesh, install: bool, reduce_dtype=None):
    model = build_model()
    mp = MixedPrecisionPolicy(param_dtype=reduce_dtype, reduce_dtype=reduce_dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    counts = None
    if install:
        assert gloo_collectives.install(model, mesh.get_group()) == 3
        counts = [Counting(gloo_collectives.BroadcastAllGather()),
                  Counting(gloo_collectives.AllReduceReduceScatter())]
        for unit in (model, model[0], model[2]):
            unit.set_custom_all_gather(counts[0])
            unit.set_custom_reduce_scatter(counts[1])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank = mesh.get_group().rank()
    g = torch.Generator().manual_seed(100 + rank)
    weight = 1.0 if rank < 2 else 0.0  # two non-zero terms per sum (docstring)
    for _ in range(3):
        x = torch.randn(4, 7, generator=g)
        (model(x).pow(2).sum() * weight).backward()
        optimizer.step()
        optimizer.zero_grad()
    params = [p.full_tensor() for p in model.parameters()]
    return params, None if counts is None else [c.calls for c in counts], \
        None if counts is None else sorted(counts[1].dtypes)


def legacy_ddp_fp16_reduce(grad: torch.Tensor, group) -> torch.Tensor:
    """Stock fairseq's legacy_ddp on an fp16 gradient, by its own code: a module holding one
    fp16 parameter whose gradient is ``grad``, wrapped in fairseq's
    ``LegacyDistributedDataParallel`` (what ``--ddp-backend legacy_ddp`` builds), whose
    ``all_reduce_grads`` (what fairseq's FP16Optimizer calls on the fp16 model) reduces it."""
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.zeros_like(grad))
    holder.weight.grad = grad.clone()
    LegacyDistributedDataParallel(holder, group).all_reduce_grads()
    return holder.weight.grad


def sharded_grad(mesh, reduce_dtype, weight: torch.Tensor, x: torch.Tensor) -> tuple:
    """This rank's fp16 local gradient of sum(linear(x)^2) and the sharded gradient FSDP2 makes
    of it, with the plugin's collectives (fp16 compute, the given reduce dtype)."""
    model = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        model.weight.copy_(weight)
    local = nn.Linear(weight.shape[1], weight.shape[0], bias=False).half()
    with torch.no_grad():
        local.weight.copy_(weight)
    local(x).float().pow(2).sum().backward()
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.float16, reduce_dtype=reduce_dtype))
    gloo_collectives.install(model, mesh.get_group())
    model(x).float().pow(2).sum().backward()
    return local.weight.grad, model.weight.grad.to_local()


def like_legacy_ddp(mesh) -> dict:
    group = mesh.get_group()
    size, rank = group.size(), group.rank()
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(8 * size, 32, generator=g) * 0.1  # the same on every rank
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank)).half()
    report = {}
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        local, shard = sharded_grad(mesh, dtype, weight, x)
        stock = legacy_ddp_fp16_reduce(local, group).view(size, -1)[rank].view_as(shard)
        report[f"reduce_{name}_equals_legacy_ddp"] = torch.equal(shard, stock.float())
        report[f"reduce_{name}_dtype"] = str(shard.dtype).removeprefix("torch.")
    for key in [k for k in report if k.endswith("_equals_legacy_ddp")]:  # on every rank
        flag = torch.tensor([int(report[key])])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        report[key] = bool(flag.item())
    # a gradient of 40,000 on every rank: weight 1, input 40,000, loss = the output
    big = nn.Linear(1, size, bias=False)
    with torch.no_grad():
        big.weight.fill_(1.0)
    fully_shard(big, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.float16, reduce_dtype=torch.float16))
    gloo_collectives.install(big, group)
    big(torch.full((1, 1), 40000.0, dtype=torch.float16)).float().sum().backward()
    stock = legacy_ddp_fp16_reduce(torch.full((size, 1), 40000.0, dtype=torch.float16), group)
    report["gradient_40000"] = {"fsdp2": big.weight.grad.to_local().flatten().tolist(),
                                "legacy_ddp": stock[rank].float().tolist()}
    return report


def checks(mesh) -> dict:
    """Parts 1 to 4 on the ranks of ``mesh``."""
    group = mesh.get_group()
    # 2 MiB: the smallest shard at which gloo's all-reduce scratch is already its fixed size
    # (test_no_full_size_temporaries)
    report = {"collectives": collectives(group, 8 * MIB // 4),
              "quarter": collectives(group, 2 * MIB // 4),
              "uneven": collectives(group, 1001)}
    theirs, _, _ = train(mesh, install=False)
    ours, calls, _ = train(mesh, install=True)
    report["train_max_diff"] = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    report["train_moved"] = min((a - b).abs().max().item()
                                for a, b in zip(ours, build_model().parameters()))
    report["calls"] = calls
    report["world_size"] = group.size()
    report["like_legacy_ddp"] = like_legacy_ddp(mesh)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        theirs, _, _ = train(mesh, install=False, reduce_dtype=dtype)
        ours, calls, dtypes = train(mesh, install=True, reduce_dtype=dtype)
        report[f"reduce_{name}"] = {
            "max_diff": max((a - b).abs().max().item() for a, b in zip(ours, theirs)),
            "moved": min((a - b).abs().max().item()
                         for a, b in zip(ours, build_model().parameters())),
            "calls": calls, "reduce_scatter_dtypes": dtypes}
    return report


def main() -> None:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 4, "run on 4 ranks (the 2-rank checks use ranks 0 and 1)"
    reports = {"4": checks(init_device_mesh("cpu", (4,)))}
    pair = dist.new_group([0, 1])  # every rank takes part in making it
    if dist.get_rank() < 2:
        reports["2"] = checks(DeviceMesh.from_group(pair, "cpu"))
    report_and_exit(reports, print_here=dist.get_rank() == 0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
