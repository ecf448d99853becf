"""One rank of tests/test_tied_early_reduce.py: the tied embedding's sharded gradient with the
early reduce (sharding/tied_grad_reduce.py) against FSDP2's own reduction of the hub's buffer.
Prints one ``PROBE {json}``.

Per case, two copies of a small model with one weight tied three ways (two lookups and an
output projection, as an NLLB encoder-decoder uses its embedding), the same weights on every
rank, sharded alike (the tied modules one grouped unit, the layer one, the root) with the
plugin's gloo collectives; one copy gets the reducer. Each rank runs its own batch (other
tokens per rank, and other counts), forward and backward twice (FSDP2's lazy initialization in
between; gradients zeroed between, as fairseq does), then a third backward onto the kept
gradient (accumulation). Reported per case, the worst over all ranks' shards: the largest ratio of the two sharded
gradients' difference to its rounding bound, per element (the bound from the terms each rank added:
``Terms``), the same ratio for the lookups' rows alone (how far dropping them would land),
dtypes and placements, and whether the projection's dense part was already reduced and freed
when the first lookup's rows arrived (the memory the early reduce is for).

Argument: the mesh shape (``2`` or ``2x2``: HSDP, replicate x shard)."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from probe_report import report_and_exit

from fairseq_fsdp2.criterions.fused import fused_vocabulary_loss
from fairseq_fsdp2.sharding import gloo_collectives, tied_grad_buffer, tied_grad_reduce
from fairseq_fsdp2.sharding.sixteen_bit_grads import keep_reduce_dtype_grads

PAD = 1
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


class Terms:
    """Per element of the tied weight, what the ranks add into its gradient: the sum of the
    terms' magnitudes (float64) and their count. The projection's part is one term per rank
    and backward (both paths sum its chunks alike, into the same buffer); each lookup row is
    one. Recorded through the hub's own calls (the original runs unchanged)."""

    def __init__(self, vocab, dim):
        self.absum = torch.zeros(vocab, dim, dtype=torch.float64)
        self.rows_absum = torch.zeros(vocab, dim, dtype=torch.float64)
        self.count = torch.zeros(vocab, 1, dtype=torch.float64)
        self.on = False
        self.first_rows: dict[int, bool] = {}  # per hub: its buffer freed when rows first came
        state = tied_grad_buffer._HubState
        done, add_rows = state.projection_done, state.add_rows
        terms = self

        def projection_done(hub):
            if terms.on and hub.pending == 1 and hub.buffer is not None:
                terms.absum += hub.buffer.double().abs()
                terms.count += 1
            done(hub)

        def rows(hub, index, values):
            if terms.on:
                terms.first_rows.setdefault(id(hub), hub.buffer is None)
                keep = values.double().abs()
                terms.absum.index_add_(0, index, keep)
                terms.rows_absum.index_add_(0, index, keep)
                terms.count.index_add_(0, index, torch.ones(index.numel(), 1, dtype=torch.float64))
            add_rows(hub, index, values)
        state.projection_done, state.add_rows = projection_done, rows

    def shard(self, reducer):
        for t in (self.absum, self.rows_absum, self.count):
            dist.all_reduce(t)
        rows = slice(reducer.first_row, reducer.first_row + reducer.local_rows)
        return (self.absum[rows] / reducer.divisor(), self.rows_absum[rows] / reducer.divisor(),
                self.count[rows])


class Tied(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.src = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.tgt = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.layer = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.tgt.weight = self.src.weight
        self.out.weight = self.src.weight

    def forward(self, src, tgt, fused: bool, scale: float, hinted: bool = True):
        h = torch.tanh(self.layer(self.src(src).mean(1, keepdim=True) + self.tgt(tgt)))
        h = h.reshape(-1, h.size(-1))
        target = tgt.reshape(-1).flip(0)
        if fused:
            weight, hub = self.out.tied_gradient.alias(self.out.weight)
            loss = fused_vocabulary_loss(h, weight, target, eps=0.1, chunk_tokens=7,
                                         grad_scale=scale if hinted else None, hub=hub)[0]
            return loss if hinted else loss * scale
        logits = self.out(h).float()
        return F.cross_entropy(logits, target, reduction="sum") * scale


def build(mesh, vocab, dim, dtype, early, chunk_bytes, nccl_path=False):
    torch.manual_seed(0)
    model = Tied(vocab, dim)
    tied_grad_buffer.install(model)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) \
        if dtype != torch.float32 else MixedPrecisionPolicy()
    fully_shard([model.src, model.tgt, model.out], mesh=mesh, mp_policy=policy)
    fully_shard(model.layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    gloo_collectives.install(model, mesh.get_group(mesh.ndim - 1))
    if dtype != torch.float32:
        keep_reduce_dtype_grads(model)
    if early:
        assert tied_grad_reduce.install(model) == 1
        reducer = model.out.tied_gradient.reducer
        reducer.row_chunk_bytes = chunk_bytes
        if nccl_path:  # the reduce-scatter NCCL runs (gloo's own, here): the buffer as its
            reducer.comm = tied_grad_reduce.reduce_scatter  # input or chunks of it
    return model


def batch(vocab, rank, step, tokens):
    g = torch.Generator().manual_seed(100 * rank + step)
    n = tokens + 3 * rank  # other counts per rank (the rows' exchange pads them)
    src = torch.randint(2, vocab, (2, n), generator=g)
    tgt = torch.randint(2, vocab, (2, n), generator=g)
    src[0, -1] = PAD  # a padding lookup: no gradient row
    return src, tgt


def run_case(mesh, vocab, dim, dtype, fused, tokens, chunk_bytes, terms, hinted=True,
             nccl_path=False):
    rank = dist.get_rank()
    scale = 64.0 if dtype == torch.float16 else 1.0  # a loss scale, as fairseq's --fp16
    models = [build(mesh, vocab, dim, dtype, early, chunk_bytes, nccl_path)
              for early in (True, False)]
    grads = []
    for m in models:
        for step in range(3):
            if step < 2:
                m.zero_grad(set_to_none=True)
            terms.on = m is models[0] and step > 0  # the terms of the gradient compared
            src, tgt = batch(vocab, rank, step, tokens)
            m(src, tgt, fused, scale, hinted).backward()
        grads.append(m.src.weight.grad)
    terms.on = False
    ours, fsdp2 = grads
    absum, rows_absum, count = terms.shard(models[0].out.tied_gradient.reducer)
    # DERIVED bound, per element: each path sums the same terms (count of them, magnitudes
    # absum, over all ranks and both backward passes, divided as FSDP2 divides) in another
    # order and grouping, each addition rounding by at most u (the coarsest format summed in:
    # the compute/reduce dtype) of a partial sum bounded by absum; plus one rounding each of
    # the result (the cast to the shard's dtype). Dividing by a power of 2 is exact. So the
    # two differ by at most 2 x (count + 1) x u x absum.
    bound = 2 * (count + 1) * UNIT_ROUNDOFF[dtype] * absum
    a, b = ours.to_local().double(), fsdp2.to_local().double()
    diff = (a - b).abs()
    ratio = torch.where(bound > 0, diff / bound, diff * float("inf")).nan_to_num(0.0)
    laid_out = isinstance(ours, DTensor) and ours.placements == fsdp2.placements \
        and ours.shape == fsdp2.shape and ours.to_local().dtype == fsdp2.to_local().dtype
    # every rank's shard: the largest ratios, and the checks' worst (0 = failed on some rank)
    worst = torch.tensor([float(ratio.max()), float((rows_absum / bound.clamp_min(1e-300)).max()),
                          float(diff.max()), float(b.abs().max()), -float(laid_out),
                          -float(b.abs().sum() > 0),
                          -float(bool(terms.first_rows) and all(terms.first_rows.values()))],
                         dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"ratio": float(worst[0]), "rows_ratio": float(worst[1]), "diff": float(worst[2]),
            "scale": float(worst[3]), "dtype": str(ours.to_local().dtype),
            "stock_dtype": str(fsdp2.to_local().dtype), "dtensor": bool(worst[4] < 0),
            "nonzero": bool(worst[5] < 0), "freed_before_rows": bool(worst[6] < 0)}


def main() -> None:
    dist.init_process_group("gloo")
    shape = [int(x) for x in sys.argv[1].split("x")]
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    report = {}
    # vocab 1001 (odd: padded rows) x dim 8, few tokens: the rows' exchange; vocab 37 with as
    # many tokens: the rows folded into the dense path. chunk of 200 bytes: several calls.
    cases = {"sparse fp32 fused": (1001, 8, torch.float32, True, 9),
             "sparse fp32 unfused": (1001, 8, torch.float32, False, 9),
             "dense fp32 fused": (37, 8, torch.float32, True, 40),
             "sparse fp16 fused": (1001, 8, torch.float16, True, 9),
             "sparse bf16 unfused": (1001, 8, torch.bfloat16, False, 9),
             # the fused loss without the loss scale's hint: an fp32 buffer for an fp16
             # reduction, copied into the reduction's input a chunk of rows at a time
             "sparse fp16 fused, fp32 buffer": (1001, 8, torch.float16, True, 9, False),
             # the path taken on NCCL: even shards reduce-scattered from the buffer itself,
             # uneven ones in chunks
             "nccl path, even shards": (1000, 8, torch.float16, True, 9, True, True),
             "nccl path, uneven shards": (1001, 8, torch.float32, False, 9, True, True)}
    if len(shape) == 2:
        cases = {k: v for k, v in cases.items() if k in ("sparse fp32 fused",
                                                         "sparse fp16 fused")}
    for name, (vocab, dim, dtype, fused, tokens, *hinted) in cases.items():
        report[name] = run_case(mesh, vocab, dim, dtype, fused, tokens, 200, Terms(vocab, dim),
                                *hinted)
    report_and_exit(report, print_here=dist.get_rank() == 0)


if __name__ == "__main__":
    main()
