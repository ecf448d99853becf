"""The tied embedding's gradient reduced early, as this rank's shard (on by default with the
tied-gradient buffer; ``--fsdp2-no-tied-early-reduce`` turns it off).

What: with the tied-gradient buffer (tied_grad_buffer.py) the output projection's dense
vocab x dim contribution sits in the hub's buffer from the start of backward (the fused loss
adds it in forward) to its end, where FSDP2 copies the buffer into its reduce-scatter input and
reduce-scatters it: two vocab x dim tensors at the end, one through the whole backward. Here
the projection's contribution is reduced as soon as it is complete (its backward, the first
node of backward with the fused loss) into this rank's shard, in the reduce dtype, and the
buffer is freed. The buffer itself is the reduction's input where it is in the reduce dtype
(gloo: all-reduced in place, as gloo_collectives.py's reduce-scatter does, and this rank's rows
copied out; NCCL: reduce-scattered as it is when every shard has the same rows); otherwise it
is copied into the input a chunk of rows at a time (ROW_CHUNK_BYTES), so no second vocab x
dim tensor exists. The input lookups' rows (at most the batch's tokens each) are kept as
(index, rows) and exchanged at the end of backward: every rank all-gathers the indices and
rows and adds those that fall in its shard. Then the shard is cast as FSDP2 casts its output
(to the parameters' fp32, or kept in the 16-bit reduce dtype by sixteen_bit_grads.py) and becomes
the sharded parameter's ``.grad`` (a DTensor on its mesh and placements, as FSDP2 sets it;
added to a gradient already there). The weight's unsharded gradient stays None, so FSDP2
neither copies nor reduces it. FSDP2's divide factors are used for both parts, so the result
is FSDP2's up to float rounding (the sum grouped as dense + rows instead of one sum); the
16-bit shard and its fp32 cast are the same values, as with FSDP2.

Cost: at the start of backward the dense gradient and this rank's shard (vocab x dim / ranks)
are alive together, where the activations are largest; the end of backward then holds neither
the gradient nor FSDP2's copy of it. Which moment sets the peak: the estimator tells.

The rows' exchange (``sparse_fits``): chosen when all ranks' rows, gathered, take at most the
bytes of the dense vocab x dim gradient; otherwise (huge world sizes or batches against a small
vocabulary) every rank adds its rows into a dense buffer and reduces it as the projection's.
A rank whose rows alone outgrow that bound folds them into a dense buffer at once.

When (``applies``, the one place that decides; the estimator follows it): the tied-gradient
buffer is on, the option is not off, the embedding is sharded on dim 0 over more than one rank,
no --cpu-offload (FSDP2 moves the gradients to the CPU), no --fsdp2-no-sync-micro-batches with
--update-freq > 1 (FSDP2 keeps unsharded gradients between micro-batches). Elsewhere the hub
hands its buffer to FSDP2 as before. Every rank must run the same backward graph (data
parallel training does): the early reduce is a collective at the projection's backward.

Private torch state read (marked; no public getter exists): the FSDP2 parameter group's divide
factor settings and output dtype (``gradient_divide_factor``, ``force_sum_reduction_for_comms``,
``_orig_dtype``, via sixteen_bit_grads.param_groups) and torch's ``_get_gradient_divide_factors``
(torch 2.13, ``torch.distributed.fsdp._fully_shard._fsdp_collectives``), used rather than
copied so the factors stay FSDP2's; tests/test_tied_early_reduce.py compares the gradient with
FSDP2's own and fails if torch changes them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (  # private: see above
    _get_gradient_divide_factors)
from torch.distributed.tensor import DTensor, Shard

from .. import chunks
from ..options import tied_grad_buffer_on
from .gloo_collectives import AllReduceReduceScatter
from .sixteen_bit_grads import param_groups

#: the reduce-scatter input built per call: at most this many bytes (one chunk of rows of
#: every rank's shard), so that no second vocab x dim tensor exists
ROW_CHUNK_BYTES = chunks.TIED_REDUCE_BYTES
#: bytes of one gathered row index (int64)
INDEX_BYTES = 8


def applies(dt, shards: int, update_freq: int = 1) -> bool:
    """Whether the tied embedding's gradient is reduced early, from the run's options and its
    shard group size (world size / HSDP replicas); apply-time checks of the parameter itself
    (sharded on dim 0): ``install``."""
    return (tied_grad_buffer_on(dt) and not getattr(dt, "fsdp2_no_tied_early_reduce", False)
            and shards > 1 and not getattr(dt, "cpu_offload", False)
            and not (getattr(dt, "fsdp2_no_sync_micro_batches", False) and update_freq > 1))


def sparse_fits(gathered_rows: int, dim: int, element_bytes: int, vocab: int) -> bool:
    """Whether ``gathered_rows`` rows (all ranks' lookups, padded to the largest rank's) with
    their indices take at most the dense vocab x dim gradient's bytes."""
    return gathered_rows * (dim * element_bytes + INDEX_BYTES) <= vocab * dim * element_bytes


def buffer_is_input(same_dtype: bool, gloo: bool, vocab: int, shards: int) -> bool:
    """Whether the dense buffer itself is the reduction's input (no chunk copies): in the
    reduce dtype, and on gloo (all-reduced in place) or with every shard the same rows (NCCL's
    reduce-scatter reads it as it is). The estimator follows the same rule."""
    return same_dtype and (gloo or vocab % shards == 0)


def chunk_rows(shards: int, dim: int, element_bytes: int, shard_rows: int,
               limit: int = ROW_CHUNK_BYTES) -> int:
    """Rows of each rank's shard reduced per call: the input (shards x rows x dim) within
    ``limit`` bytes, at least one row."""
    return max(1, min(shard_rows, chunks.rows_per_chunk(shards * dim * element_bytes, limit)))


class TiedShardReducer:
    """Reduces parts of the tied weight's unsharded gradient into its sharded ``.grad``."""

    row_chunk_bytes = ROW_CHUNK_BYTES

    def __init__(self, param: nn.Parameter, group) -> None:
        self.param, self.group = param, group  # the sharded DTensor parameter, its FSDP2 group
        mesh, placements = param.device_mesh, param.placements
        self.shard_dim = next(i for i, p in enumerate(placements) if isinstance(p, Shard))
        self.shard_group = mesh.get_group(self.shard_dim)
        self.shards = mesh.size(self.shard_dim)
        self.shard_rank = mesh.get_local_rank(self.shard_dim)
        self.replicate_group = mesh.get_group(1 - self.shard_dim) if mesh.ndim == 2 else None
        self.groups = [mesh.get_group(i) for i in range(mesh.ndim)]  # all ranks, stage by stage
        self.vocab, self.dim = param.shape[0], param.shape[1]
        self.padded_rows = -(-self.vocab // self.shards)
        self.first_row = self.shard_rank * self.padded_rows
        self.local_rows = param.to_local().shape[0]
        gloo = dist.get_backend(self.shard_group) == dist.Backend.GLOO
        self.comm = AllReduceReduceScatter() if gloo else reduce_scatter

    def _factors(self, reduce_dtype: torch.dtype):
        g = self.group  # private FSDP2 state: see the module's docstring
        return _get_gradient_divide_factors(
            self.shard_group, self.replicate_group, reduce_dtype, self.param.device.type,
            g.gradient_divide_factor, g.force_sum_reduction_for_comms)

    def reduce_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        return self.group.mp_policy.reduce_dtype or grad_dtype

    def divisor(self) -> float:
        """What FSDP2's reduction divides the sum over all ranks by (pre x post factor, or
        its AVG / PREMUL_SUM op)."""
        factor = self.group.gradient_divide_factor
        n = self.shards * (dist.get_world_size(self.replicate_group)
                           if self.replicate_group is not None else 1)
        return float(factor) if factor is not None else float(n)

    def in_place(self, dense: torch.Tensor, reduce_dtype: torch.dtype) -> bool:
        """Whether ``dense`` itself is the reduction's input (``buffer_is_input``)."""
        return buffer_is_input(dense.dtype == reduce_dtype,
                               isinstance(self.comm, AllReduceReduceScatter), self.vocab,
                               self.shards)

    def reduce_dense(self, dense: torch.Tensor, reduce_dtype: torch.dtype,
                     into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's shard (local rows, in the reduce dtype, FSDP2's divide factors applied)
        of the sum over all ranks of a vocab x dim gradient, added into ``into`` if given.
        ``dense`` (this rank's part) is used up: the input of the reduction where in_place,
        else copied a chunk of rows at a time (at most ``row_chunk_bytes`` per call)."""
        pre, post, rs_op, ar_op = self._factors(reduce_dtype)
        if self.in_place(dense, reduce_dtype):
            if pre is not None and pre != 1:
                dense.div_(pre)
            if isinstance(self.comm, AllReduceReduceScatter):  # gloo: as FSDP2's unit does
                dist.all_reduce(dense, op=rs_op, group=self.shard_group)
                out = dense[self.first_row:self.first_row + self.local_rows].clone()
            else:
                out = torch.empty((self.padded_rows, self.dim), dtype=reduce_dtype,
                                  device=dense.device)
                self.comm(output_tensor=out.view(-1), input_tensor=dense.view(-1),
                          group=self.shard_group, op=rs_op)
        else:
            out = torch.empty((self.padded_rows, self.dim), dtype=reduce_dtype,
                              device=dense.device)
            step = chunk_rows(self.shards, self.dim, out.element_size(), self.padded_rows,
                              self.row_chunk_bytes)
            for start in range(0, self.padded_rows, step):
                n = min(step, self.padded_rows - start)
                chunk = torch.zeros((self.shards, n, self.dim), dtype=reduce_dtype,
                                    device=dense.device)
                for rank in range(self.shards):
                    lo = rank * self.padded_rows + start
                    rows = dense[lo:min(lo + n, self.vocab)]
                    chunk[rank, :rows.size(0)].copy_(rows)
                if pre is not None and pre != 1:
                    chunk.div_(pre)
                self.comm(output_tensor=out[start:start + n].view(-1),
                          input_tensor=chunk.view(-1), group=self.shard_group, op=rs_op)
                del chunk
            out = out[:self.local_rows]
        if self.replicate_group is not None:  # HSDP: then across the replicas, as FSDP2
            dist.all_reduce(out, op=ar_op, group=self.replicate_group)
        if post is not None and post != 1:
            out.div_(post)
        if into is None:
            return out
        return into.add_(out)

    def reduce_rows(self, shard: Optional[torch.Tensor], index: torch.Tensor,
                    rows: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        """Every rank's (index, rows) that fall in this rank's shard, divided as FSDP2 divides
        the sum, added into ``shard`` (created as zeros if None; the reduce dtype) and
        returned (collective: all ranks call it, each with its own rows)."""
        for group in self.groups:
            index, rows = _all_gather_rows(index, rows, group)
        own = (index >= self.first_row) & (index < self.first_row + self.local_rows)
        if shard is None:
            shard = torch.zeros((self.local_rows, self.dim), dtype=reduce_dtype,
                                device=rows.device)
        picked = rows[own].to(shard.dtype)
        return shard.index_add_(0, index[own] - self.first_row, picked,
                                alpha=1.0 / self.divisor())

    def commit(self, shard: torch.Tensor) -> None:
        """The reduced shard becomes the sharded parameter's gradient, cast as FSDP2 casts
        its reduce-scatter output (to ``_orig_dtype``), or is added to the one there."""
        shard = shard.to(self.group._orig_dtype or shard.dtype)  # private: see the docstring
        with torch.no_grad():
            if self.param.grad is None:
                self.param.grad = DTensor.from_local(
                    shard.contiguous(), self.param.device_mesh, self.param.placements,
                    run_check=False, shape=self.param.shape, stride=self.param.stride())
            else:  # accumulate, as FSDP2 does
                self.param.grad.to_local().add_(shard)


def reduce_scatter(output_tensor, input_tensor, group, op) -> None:
    """The reduce-scatter on backends other than gloo (NCCL): torch's own."""
    dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)


def _all_gather_rows(index: torch.Tensor, rows: torch.Tensor, group):
    """Every rank's (index, rows) of ``group``, concatenated (each padded to the largest
    count with index -1, which no shard holds)."""
    size = dist.get_world_size(group)
    if size == 1:
        return index, rows
    counts = torch.empty(size, dtype=torch.int64, device=index.device)
    dist.all_gather_single(counts, torch.tensor([index.numel()], device=index.device),
                           group=group)
    most = int(counts.max())
    pad = most - index.numel()
    if pad:
        index = torch.cat([index, index.new_full((pad,), -1)])
        rows = torch.cat([rows, rows.new_zeros((pad, rows.size(1)))])
    all_index = index.new_empty((size * most,))
    all_rows = rows.new_empty((size * most, rows.size(1)))
    dist.all_gather_single(all_index, index.contiguous(), group=group)
    dist.all_gather_single(all_rows, rows.contiguous(), group=group)
    return all_index, all_rows


def gathered_row_count(count: int, folded: bool, groups, device) -> Optional[int]:
    """The rows every rank would gather (all ranks' largest count times the ranks), or None
    when some rank folded its rows into a dense buffer (collective)."""
    n = 1
    value = torch.tensor([-1 if folded else count], dtype=torch.int64, device=device)
    for group in groups:
        size = dist.get_world_size(group)
        gathered = torch.empty(size, dtype=torch.int64, device=device)
        dist.all_gather_single(gathered, value, group=group)
        value = gathered.min().reshape(1) if int(gathered.min()) < 0 else gathered.max().reshape(1)
        n *= size
    return None if int(value) < 0 else int(value) * n


def install(model: nn.Module) -> int:
    """Give each tied-gradient hub of the sharded ``model`` (tied_grad_buffer.install, then
    sharded) its reducer, where the parameter is a dim-0 sharded DTensor; returns the number
    of hubs given one. Call once the model is sharded and materialized, when ``applies``."""
    groups = param_groups(model)
    done = 0
    for module in model.modules():
        hub = getattr(module, "tied_gradient", None)
        param = getattr(module, "weight", None)
        if hub is None or hub.reducer is not None or not isinstance(param, DTensor):
            continue
        placements = param.placements
        shard = [p for p in placements if isinstance(p, Shard)]
        if len(shard) != 1 or shard[0].dim != 0 or param.device_mesh.ndim > 2:
            continue
        group = next((g for g in groups for fp in g.fsdp_params if fp.sharded_param is param),
                     None)
        if group is None or param.device_mesh.size(placements.index(shard[0])) < 2:
            continue
        hub.reducer = TiedShardReducer(param, group)
        done += 1
    return done
