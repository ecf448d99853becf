"""One gradient buffer for a tied embedding (``--fsdp2-tied-grad-buffer``).

What: with ``--share-all-embeddings`` one vocab x dim weight is used three times (encoder
input, decoder input, output projection). In stock autograd each use's backward creates its
own dense vocab x dim gradient, and the engine sums them before the weight's ``.grad`` is set
and FSDP2 reduce-scatters it: up to 3 full copies exist at once on every rank (measured with
``--fsdp2-memory-breakdown``: "grads before reduce-scatter" peaks at 3 x vocab x dim x 4
bytes; about 3 GiB per rank at NLLB size in fp32).

How: the modules holding the tied weight (``nn.Embedding`` without max_norm/sparse/
scale_grad_by_freq, ``nn.Linear`` without bias) get a forward that routes the weight through
one *hub* per forward pass. Each use's backward adds its contribution into the hub's single
buffer (``addmm_`` for the projection, ``index_add_`` of the looked-up rows for an embedding,
as PyTorch's CPU embedding backward itself does) and returns no weight gradient; the hub's
backward, which autograd runs only after every use's backward (they all depend on it), hands
the buffer to the weight as its gradient. So at most one vocab x dim gradient exists, and
``.grad``, FSDP2's reduce-scatter and its timing are those of the stock path. The result is the
same sum, added in a different order (float rounding only).

Reduced early (tied_grad_reduce.py, where a reducer is installed): the projection's part is
reduced into the sharded gradient once every projection use's backward has run (each use
counts itself in forward: ``projection_begins`` / ``projection_done``), and the lookups' rows
are kept as rows and exchanged by the hub's backward, which then hands autograd no gradient.

Without grad mode, or when the weight does not require grad, the stock forward runs.
The module classes are changed on the instance (as ``fully_shard`` itself does), before
sharding; parameter names, state dicts and checkpoints are unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .plan import tied_groups
from .tied_grad_reduce import gathered_row_count, sparse_fits


class _HubState:
    """The buffer shared by one forward pass's uses of the tied weight."""

    def __init__(self, weight: torch.Tensor, reducer=None) -> None:
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device
        self.element_size = weight.element_size()
        self.buffer: Optional[torch.Tensor] = None
        self.backward_started = False
        self.reducer = reducer  # tied_grad_reduce.TiedShardReducer: reduced early
        self.pending = 0  # projection uses whose backward has not run yet
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # the lookups' (index, rows)
        self.row_count = 0
        self.shard: Optional[torch.Tensor] = None  # this rank's reduced shard (reduce dtype)

    def add_rows(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        self.backward_started = True
        if self.reducer is not None and self.buffer is None:
            self.rows.append((index, rows.to(self.dtype)))
            self.row_count += index.numel()
            if not sparse_fits(self.row_count, self.shape[1], self.element_size, self.shape[0]):
                self._fold_rows()  # more rows than the dense gradient
            return
        if self.buffer is None:
            self.buffer = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.buffer.index_add_(0, index, rows.to(self.buffer.dtype))

    def _fold_rows(self) -> None:
        """The kept lookups' rows added into the dense buffer (made if there is none)."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        for index, rows in self.rows:
            self.buffer.index_add_(0, index, rows.to(self.buffer.dtype))
        self.rows = []

    def projection_begins(self) -> None:
        self.pending += 1

    def projection_done(self) -> None:
        """A projection use's contribution is complete; once all are, reduce them early."""
        self.pending -= 1
        if self.pending == 0 and self.reducer is not None and self.buffer is not None:
            self._reduce_buffer()

    def _reduce_buffer(self) -> None:
        buffer, self.buffer = self.buffer, None
        self.shard = self.reducer.reduce_dense(buffer, self.reducer.reduce_dtype(self.dtype),
                                               self.shard)
        del buffer

    def finish(self, grad: Optional[torch.Tensor]) -> None:
        """The hub's backward with a reducer: the rows exchanged (or, where the rule or a
        leftover dense part says so, reduced densely on every rank alike)."""
        if grad is not None:  # the alias was also used outside our functions
            self.buffer = grad.clone() if self.buffer is None else self.buffer.add_(grad)
        reducer = self.reducer
        gathered = gathered_row_count(self.row_count, self.buffer is not None, reducer.groups,
                                      self.device)
        if gathered is not None and sparse_fits(gathered, self.shape[1], self.element_size,
                                                self.shape[0]):
            if self.rows:
                index = torch.cat([i for i, _ in self.rows])
                values = torch.cat([r for _, r in self.rows])
            else:
                index = torch.empty(0, dtype=torch.int64, device=self.device)
                values = torch.empty((0, self.shape[1]), dtype=self.dtype, device=self.device)
            self.rows = []
            self.shard = reducer.reduce_rows(self.shard, index, values,
                                             reducer.reduce_dtype(self.dtype))
        else:
            self._fold_rows()
            self._reduce_buffer()
        shard, self.shard = self.shard, None
        reducer.commit(shard)

    def add_outer(self, grad_out: torch.Tensor, inputs: torch.Tensor,
                  dtype: Optional[torch.dtype] = None) -> None:
        """buffer += grad_out^T @ inputs (the weight gradient of ``inputs @ weight^T``), in
        place; the first call creates the buffer (in ``dtype``, default the weight's). Called
        from backward by the projection, and from forward by the fused vocabulary loss
        (criterions/fused.py), which computes its share there."""
        if self.buffer is None:
            self.buffer = grad_out.t().mm(inputs).to(dtype or self.dtype)
        else:
            self.buffer.addmm_(grad_out.t().to(self.buffer.dtype),
                               inputs.to(self.buffer.dtype))

    def scale(self, factor: torch.Tensor) -> None:
        """Scale what the fused loss added in forward by backward's grad_output (before any
        lookup's rows arrive: they come from backward further down the graph)."""
        if self.buffer is not None:
            self.buffer.mul_(factor)

    def take(self) -> Optional[torch.Tensor]:
        buffer, self.buffer = self.buffer, None
        return buffer


class _Hub(torch.autograd.Function):
    """weight -> an alias of it; backward returns the buffer the uses accumulated."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, state: _HubState) -> torch.Tensor:
        ctx.state = state
        ctx.set_materialize_grads(False)  # the uses return None: no zero vocab x dim tensor
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):
        if ctx.state.reducer is not None:  # reduced into the shard: FSDP2 gets nothing
            ctx.state.finish(grad)
            return None, None
        buffer = ctx.state.take()
        if grad is not None:  # the alias was also used outside our functions
            buffer = grad if buffer is None else buffer.add_(grad)
        return buffer, None


class _EmbeddingUse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor, state: _HubState,
                padding_idx: Optional[int]) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.state, ctx.padding_idx = state, padding_idx
        ctx.set_materialize_grads(False)
        return F.embedding(tokens, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):
        if grad is not None:
            (tokens,) = ctx.saved_tensors
            index = tokens.reshape(-1)
            rows = grad.reshape(index.numel(), -1)
            if ctx.padding_idx is not None:  # the padding row gets no gradient from a lookup
                rows = rows.masked_fill((index == ctx.padding_idx).unsqueeze(1), 0)
            ctx.state.add_rows(index, rows)
        return None, None, None, None


class _LinearUse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs: torch.Tensor, weight: torch.Tensor,
                state: _HubState) -> torch.Tensor:
        ctx.save_for_backward(inputs, weight)
        ctx.state = state
        ctx.set_materialize_grads(False)
        state.projection_begins()
        return F.linear(inputs, weight)

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):
        if grad is None:
            ctx.state.projection_done()
            return None, None, None
        inputs, weight = ctx.saved_tensors
        grad_inputs = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.state.backward_started = True
        ctx.state.add_outer(grad.reshape(-1, grad.size(-1)),
                            inputs.reshape(-1, inputs.size(-1)))
        ctx.state.projection_done()
        return grad_inputs, None, None


class TiedGradient:
    """The hub of one tied weight, shared by every module holding it."""

    def __init__(self) -> None:
        self._current: Optional[tuple[torch.Tensor, torch.Tensor, _HubState]] = None
        self.reducer = None  # tied_grad_reduce.install: the gradient reduced early

    def alias(self, weight: torch.Tensor) -> tuple[torch.Tensor, _HubState]:
        """The hub for this forward pass: the current one, unless its backward has begun or
        it belongs to another weight object; then a new one."""
        cur = self._current
        if cur is None or cur[0] is not weight or cur[2].backward_started:
            state = _HubState(weight, self.reducer)
            cur = self._current = (weight, _Hub.apply(weight, state), state)
        return cur[1], cur[2]


def _tracked(weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and weight.requires_grad


class TiedGradEmbedding(nn.Embedding):
    """``nn.Embedding`` whose weight gradient goes into the tied weight's one buffer."""

    tied_gradient: TiedGradient

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not _tracked(self.weight):
            return super().forward(tokens)
        weight, state = self.tied_gradient.alias(self.weight)
        return _EmbeddingUse.apply(tokens, weight, state, self.padding_idx)


class TiedGradLinear(nn.Linear):
    """``nn.Linear`` (no bias) whose weight gradient goes into the tied weight's one buffer."""

    tied_gradient: TiedGradient

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not _tracked(self.weight):
            return super().forward(inputs)
        weight, state = self.tied_gradient.alias(self.weight)
        return _LinearUse.apply(inputs, weight, state)


def _convertible(module: nn.Module) -> bool:
    if type(module) is nn.Embedding:
        return (module.max_norm is None and not module.sparse
                and not module.scale_grad_by_freq)
    return type(module) is nn.Linear and module.bias is None


def install(model: nn.Module) -> list[list[str]]:
    """Give each tied weight held only by plain embeddings / bias-free linears one gradient
    buffer. Call before sharding. Returns the module groups converted."""
    modules = dict(model.named_modules())
    converted = []
    for group in tied_groups(model):
        members = [modules[path] for path in group]
        if len(members) < 2 or not all(_convertible(m) for m in members):
            continue
        hub = TiedGradient()
        for m in members:
            m.__class__ = TiedGradEmbedding if type(m) is nn.Embedding else TiedGradLinear
            m.tied_gradient = hub
        converted.append(group)
    return converted
