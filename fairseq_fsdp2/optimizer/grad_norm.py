"""The global gradient norm over FSDP2's sharded (DTensor) gradients, and the device a
process group's collectives need.

Why not fairseq's ``utils.clip_grad_norm_``: it only sees tensors. With apex installed (common
in GPU images) it sums ``multi_tensor_total_norm`` over each gradient's *local* shard, i.e. this
rank's part of the norm, not the model's; without apex, on a CUDA machine it moves every
per-tensor norm to ``cuda.current_device()``, which mixes devices once ``--cpu-offload`` keeps
the gradients on the CPU.

FSDP2's gradients (one mesh, ``Shard`` or ``Replicate`` on each of its dimensions): each local
shard's norm, their squares summed by one all-reduce over each sharded mesh dimension (HSDP's
replicas counted once) on the device the group's backend moves (NCCL: CUDA) wherever the
gradients live, then the norm of the per-tensor norms: what PyTorch's ``get_total_norm``
computes over the DTensors, bit for bit (a local shard of more than STEP_CHUNK elements: the
norm of its row chunks' norms, so that a 16-bit gradient shard is widened a chunk at a time,
``local_norm``; float rounding only). Through DTensor instead, every first call in a process
paid ~60 ms of sharding propagation (measured on a 2-rank tiny run; the suite starts ~200 such
processes), and its reduction ran on the gradients' own device, the CPU under --cpu-offload,
which NCCL cannot move. Anything else (plain tensors, mixed meshes, partial placements) takes
``get_total_norm``. Clipping is PyTorch's ``clip_grads_with_norm_``.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..sharding.mesh import comm_device
from .local_shard_step import SIXTEEN_BIT_GRADS, mix_into, multiply_grads
from .row_chunk_step import STEP_CHUNK, rows_per_chunk, widened


def total_norm(grads: list[torch.Tensor], factors: Sequence = ()) -> torch.Tensor:
    """The 2-norm of all ``grads`` taken together (the unsharded model's gradient norm), as a
    plain fp32 scalar tensor, the same on every rank; 16-bit gradients are taken widened, with
    the ``factors`` multiply_grads left pending for them applied in order."""
    if not grads:
        return torch.tensor(0.0)
    sharded = _sharded_layout(grads)
    if sharded is not None:
        return _norm_of_local_shards(grads, *sharded, factors)
    if any(g.dtype in SIXTEEN_BIT_GRADS for g in grads):  # by DTensor dispatch: widened whole
        grads = [widened(g, factors) for g in grads]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
    if not isinstance(norm, DTensor):
        return norm.float()
    # torch 2.13 returns it replicated (reduced already); should a release return it partial,
    # full_tensor() reduces it over the mesh, from the device the mesh's backend moves
    local = norm.to_local()
    device = comm_device(norm.device_mesh.get_group(0))
    if local.device.type != device.type:
        norm = DTensor.from_local(local.to(device), norm.device_mesh, norm.placements,
                                  run_check=False)
    return norm.full_tensor().float()


def _sharded_layout(grads: list[torch.Tensor]):
    """(mesh, the mesh dimensions the tensors are sharded over) if every one of ``grads`` is a
    DTensor on the same mesh with only Shard and Replicate placements; else None."""
    first = grads[0]
    if not isinstance(first, DTensor):
        return None
    mesh, placements = first.device_mesh, first.placements
    if any(not isinstance(g, DTensor) or g.device_mesh is not mesh or g.placements != placements
           for g in grads):
        return None
    if not all(p.is_shard() or p.is_replicate() for p in placements):
        return None
    return mesh, [dim for dim, p in enumerate(placements) if p.is_shard()]


def local_norm(grad: torch.Tensor, factors: Sequence = (), chunk: int = STEP_CHUNK,
               space: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The 2-norm of a local gradient shard in float32: of the whole, or of each chunk of rows
    (as row_chunk_step.py cuts them) and then of those norms, when it has more than ``chunk``
    elements, so that a 16-bit gradient is never widened whole. A float32 gradient and the
    16-bit one it would have been (the reduce-scatter's 16-bit output widened) take the same
    chunks: the same norm, bit for bit. A 16-bit gradient is widened into ``space`` (flat
    float32, ``widening_space``'s) when given: one buffer for every chunk, not a new one each
    (on CPU a new one costs a page fault per 4 KiB: row_chunk_step.py)."""
    rows, _, per = _row_chunking(grad, chunk)
    if grad.dim() == 0 or rows <= per:
        return torch.linalg.vector_norm(widened(grad, factors, out=space), 2.0).float()
    parts = [torch.linalg.vector_norm(widened(grad[a:a + per], factors, out=space), 2.0)
             for a in range(0, rows, per)]
    return torch.linalg.vector_norm(torch.stack(parts), 2.0).float()


def _row_chunking(grad: torch.Tensor, chunk: int) -> tuple[int, int, int]:
    """(rows, elements per row, rows per chunk) as local_norm cuts ``grad``."""
    rows = grad.shape[0] if grad.dim() else 1
    row = grad.numel() // max(rows, 1)
    return rows, row, rows_per_chunk(row, chunk)


def widening_space(grads: list[torch.Tensor], chunk: int = STEP_CHUNK) -> Optional[torch.Tensor]:
    """A float32 buffer for local_norm to widen the largest chunk of the 16-bit ``grads``
    (local shards) into; None when none is 16-bit."""
    sizes = []
    for g in grads:
        if g.dtype in SIXTEEN_BIT_GRADS:
            _, row, per = _row_chunking(g, chunk)
            sizes.append(min(g.numel(), per * row))
    if not sizes:
        return None
    return torch.empty(max(sizes), dtype=torch.float32, device=grads[0].device)


def _norm_of_local_shards(grads: list[torch.Tensor], mesh, shard_dims: list[int],
                          factors: Sequence = ()) -> torch.Tensor:
    shards = [g.to_local() for g in grads]
    space = widening_space(shards)
    return norm_of_local_norms([local_norm(g, factors, space=space) for g in shards], mesh,
                               shard_dims)


def norm_of_local_norms(local: list[torch.Tensor], mesh, shard_dims: list[int]) -> torch.Tensor:
    """The global 2-norm from each gradient's local-shard norm (local_norm), in order: their
    squares summed over the sharded mesh dimensions, then the norm of the per-tensor norms."""
    squares = torch.stack(local).square()
    for dim in shard_dims:
        group = mesh.get_group(dim)
        squares = squares.to(comm_device(group))
        dist.all_reduce(squares, group=group)
    return torch.linalg.vector_norm(squares.sqrt(), 2.0)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float,
                    local: bool = True, pending: Optional[list] = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global norm is at most ``max_norm``
    (no clipping when ``max_norm`` <= 0); returns the norm before clipping. ``pending``: the
    factors multiply_grads left pending for 16-bit gradients (local_shard_step.py); the
    clipping factor joins them."""
    params = [p for p in params if p.grad is not None]
    norm = total_norm([p.grad for p in params], pending or ())
    if max_norm > 0 and params:
        if not local:  # through DTensor dispatch
            torch.nn.utils.clip_grads_with_norm_(params, float(max_norm), norm)
            return norm
        # torch's clipping factor, taken from torch itself (a gradient of 1 clipped), then
        # applied as torch applies it (one multiplication by it per gradient), on the local
        # shards (an elementwise scale: local_shard_step.py says why), or left pending
        probe = torch.zeros(1, device=norm.device)
        probe.grad = torch.ones(1, device=norm.device)
        torch.nn.utils.clip_grads_with_norm_([probe], float(max_norm), norm)
        multiply_grads(params, probe.grad.reshape(()), pending)
    return norm


class GlobalGradNorm:
    """Mixin for a fairseq optimizer (``FairseqOptimizer``): its ``clip_grad_norm`` uses
    :func:`clip_grad_norm_` instead of fairseq's helper, and ``multiply_grads`` scales the local
    shards (local_shard_step.py). fairseq's fp16 wrappers call the wrapped
    optimizer's ``clip_grad_norm(0, ...)`` for the (scaled) norm and do their own clipping and
    overflow check around it, so that logic stays fairseq's."""

    #: scale gradients on the local shards (False: through DTensor dispatch, for comparisons)
    local_shards = True

    #: the step in backward (step_in_backward.py), where the run has it: it has stepped the
    #: gradients FSDP2 reduced, and gives the norm over those and the rest
    in_backward = None

    def pending_factors(self) -> Optional[list]:
        """The torch optimizer's list of factors pending for 16-bit gradients, if its step
        takes them (adam_stats.py)."""
        takes = getattr(self.optimizer, "takes_16_bit_grads", None)
        return self.optimizer.grad_factors if takes is not None and takes() else None

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        if self.in_backward is not None and self.in_backward.stepped():
            return self.in_backward.clip_grad_norm(max_norm, self.params)
        norm = clip_grad_norm_(self.params, max_norm, self.local_shards, self.pending_factors())
        # already global: fairseq's aggregate for its own FSDP (an all-reduce of the squared
        # norm) would sum it over the ranks once more, so it is not applied
        return norm

    def multiply_grads(self, c):
        if self.in_backward is not None:
            self.in_backward.check_factor(c)
        if self.local_shards:
            multiply_grads(self.params, c, self.pending_factors())
        else:
            super().multiply_grads(c)

    def zero_grad(self):
        super().zero_grad()
        if self.pending_factors() is not None:
            self.optimizer.grad_factors = []  # the gradients they were for are gone


def use_global_grad_norm(optimizer, local_shards: bool = True) -> None:
    """Make ``optimizer`` (a FairseqOptimizer) compute the global norm over DTensor gradients:
    its class becomes a subclass with :class:`GlobalGradNorm` first (mix_into)."""
    if not local_shards:
        optimizer.local_shards = False
    mix_into(optimizer, GlobalGradNorm)
