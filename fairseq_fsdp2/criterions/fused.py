"""Output projection, log-softmax, (label-smoothed) cross-entropy and their gradients in one
chunked pass, so that backward does no second projection.

What: ``fused_vocabulary_loss(features, weight, target, ...)`` returns the summed loss of
``log_softmax(features @ weight.T)`` against ``target``. Its forward walks the target tokens
``chunk_tokens`` at a time; for each chunk it computes the logits (in the weight's dtype, as
the stock projection does), the float32 log-softmax statistics, the loss, the gradient of the
loss with respect to the logits, and from it the chunk's gradient with respect to the features
and its contribution to the weight gradient; then the chunk's logits are freed. Backward only
scales the stored gradients by ``grad_output``. (The approach of Liger Kernel's fused linear
cross-entropy and of Cut Cross-Entropy.) Peak extra memory: one chunk's tokens x vocabulary
logits in the compute dtype, a float32 copy of FLOAT_ELEMENTS of them (a block of the chunk's
rows, whose log-softmax and gradient are computed, the gradient then written over their logits:
the same per-row float32 operations as over the whole chunk at once, so the same results, and
no float32 tokens x vocabulary block beside its 16-bit copy), the tokens x dim feature gradient
and the vocabulary x dim weight gradient, which the stock path also creates in backward. (With
float32 weights the logits are the float32 block; unhinted fp16, below, keeps a float32
gradient block per chunk.)

Where the weight gradient goes: returned from backward for the ``weight`` input, autograd adds
it to that tensor's other gradients (``.grad`` of the parameter, or FSDP2's unsharded gradient).
With a tied-gradient hub (``sharding/tied_grad_buffer.py``, ``--fsdp2-tied-grad-buffer``) the
chunks add directly into the hub's single buffer instead, which the embeddings' backward later adds their
rows to: one vocabulary x dim gradient in all.

fp16: the stored gradients would underflow unscaled (a 256k-way softmax has most probabilities
below fp16's smallest normal). The gradients are therefore computed already multiplied by
``grad_scale`` (the trainer passes the loss scale it will apply, so backward's ``grad_output``
equals it and nothing is rescaled, exactly as the stock fp16 path holds scaled gradients).
Without that hint, an fp16 weight's gradients are computed and stored in float32.

The gradient of the loss with respect to token t's logits z, with label smoothing eps over
V words (fairseq's ``label_smoothed_nll_loss``: loss = (1 - eps - eps_i) nll + eps_i smooth,
eps_i = eps / (V - 1), smooth = -sum_v log p_v) is p - (1 - eps - eps_i) onehot(t) - eps_i,
because (1 - eps - eps_i) + V eps_i = 1. Cross-entropy is eps = 0.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import chunks

#: logits copied to float32 at once (a block of a chunk's rows): 2^23, 32 MiB, about 32 tokens
#: at NLLB's 256,206 words (against 0.24 GiB for a 256-token chunk whole)
FLOAT_ELEMENTS = chunks.LOSS_FLOAT_ELEMENTS


def float_rows(vocab: int, float_elements: int = FLOAT_ELEMENTS) -> int:
    """Rows of a chunk whose float32 log-softmax is computed at once."""
    return chunks.rows_per_chunk(vocab, float_elements)


def chunk_bytes(tokens: int, vocab: int, compute_bytes: int, grad_bytes: int) -> int:
    """Bytes of temporaries a chunk of ``tokens`` holds at once (the estimator's figure): its
    logits in the compute dtype, and a float32 block of rows (16-bit gradients) or the chunk's
    float32 gradient (unhinted fp16); float32 logits are their own block."""
    logits = tokens * vocab * compute_bytes
    if compute_bytes == 4:
        return logits
    if grad_bytes == 4:
        return logits + tokens * vocab * 4
    return logits + min(float_rows(vocab), tokens) * vocab * 4


def _grad_dtype(weight: torch.Tensor, grad_scale: Optional[float]) -> torch.dtype:
    if weight.dtype == torch.float16 and grad_scale is None:
        return torch.float32  # unscaled fp16 gradients would underflow: keep them in float32
    return weight.dtype


def fused_pass(features: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
               eps: float, chunk_tokens: int, accuracy: bool, grad_scale: Optional[float],
               need_features_grad: bool, need_weight_grad: bool, weight_grad=None,
               float_elements: int = FLOAT_ELEMENTS):
    """One pass over the chunks. Returns ([loss, nll_loss] float32, n_correct or None,
    features gradient or None, weight gradient or None), gradients times ``grad_scale``.

    ``weight_grad``: the tied-gradient hub, whose ``add_outer(g, x, dtype)`` adds each chunk's
    weight gradient into its one buffer in place, instead of a buffer of this function's own.
    ``float_elements``: logits widened to float32 at once (float_rows)."""
    n, vocab = features.size(0), weight.size(0)
    gdtype = _grad_dtype(weight, grad_scale)
    scale = 1.0 if grad_scale is None else float(grad_scale)
    eps_i = eps / (vocab - 1) if eps else 0.0
    w_target = 1.0 - eps - eps_i
    need_grad = need_features_grad or need_weight_grad
    mm_weight = weight.to(gdtype) if need_grad else weight  # a copy only for unhinted fp16
    grad_features = features.new_empty(features.shape, dtype=gdtype) if need_features_grad \
        else None
    sink = weight_grad if weight_grad is not None else _Buffer()
    sums = torch.zeros(2, dtype=torch.float32, device=features.device)
    n_correct = torch.zeros((), dtype=torch.long, device=features.device) if accuracy else None
    rows_at_once = float_rows(vocab, float_elements)
    block = None  # the float32 block of rows (16-bit logits and gradients), made once
    for start in range(0, n, chunk_tokens):
        x, t = features[start:start + chunk_tokens], target[start:start + chunk_tokens]
        logits = x.matmul(weight.t())  # as the stock projection computes them
        m = t.numel()
        # the gradient's buffer: the logits themselves, unless unhinted fp16 keeps it in float32
        g = logits if gdtype == logits.dtype or not need_grad else \
            logits.new_empty(logits.shape, dtype=gdtype)
        lse, z_target = (logits.new_empty(m, dtype=torch.float32) for _ in range(2))
        z_sum = logits.new_empty(m, dtype=torch.float32) if eps else None
        for r in range(0, m, rows_at_once):  # each row's float32 operations, a block of rows
            rows, tr = slice(r, r + rows_at_once), t[r:r + rows_at_once]
            if logits.dtype == torch.float32:  # float32 weights: in place
                z = logits[rows]
            elif g.dtype == torch.float32:  # unhinted fp16: widened into the gradient
                z = g[rows].copy_(logits[rows])
            else:
                if block is None:
                    block = logits.new_empty((min(rows_at_once, chunk_tokens, n), vocab),
                                             dtype=torch.float32)
                z = block[:tr.numel()].copy_(logits[rows])
            z_target[rows] = z.gather(1, tr.unsqueeze(1)).squeeze(1)
            if accuracy:  # argmax of the logits = argmax of the log-probabilities
                n_correct += z.argmax(1).eq(tr).sum()
            if eps:
                torch.sum(z, 1, out=z_sum[rows])
            z_max = z.amax(1, keepdim=True)
            z.sub_(z_max).exp_()
            total = z.sum(1, keepdim=True)
            lse[rows] = (total.log() + z_max).squeeze(1)  # log-sum-exp of the logits
            if not need_grad:
                continue
            z.div_(total)  # softmax, in place of the logits
            if eps_i:
                z.sub_(eps_i)
            z[torch.arange(tr.numel(), device=tr.device), tr] -= w_target
            if scale != 1.0:
                z.mul_(scale)
            if g.dtype != torch.float32:  # the 16-bit gradient over the logits
                g[rows].copy_(z)
        # z views this chunk's logits (float32 weights) or its float32 gradient (unhinted
        # fp16): left bound, it would keep them alive while the next chunk's are computed,
        # two chunks of tokens x vocabulary at once where the estimator counts one
        del z
        nll = lse - z_target
        sums[1] += nll.sum()
        if eps:
            sums[0] += w_target * nll.sum() + eps_i * (vocab * lse - z_sum).sum()
        else:
            sums[0] += nll.sum()
        del logits
        if not need_grad:
            continue
        if need_features_grad:
            torch.mm(g, mm_weight, out=grad_features[start:start + chunk_tokens])
        if need_weight_grad:  # in place into the one buffer: no vocab x dim temporary
            sink.add_outer(g, x.to(gdtype), gdtype)
        del g
    if need_weight_grad and n == 0:  # every rank must hand FSDP2 a gradient
        sink.add_outer(features.new_zeros((0, vocab), dtype=gdtype),
                       features.new_zeros((0, features.size(1)), dtype=gdtype), gdtype)
    grad_weight = sink.buffer if need_weight_grad and weight_grad is None else None
    return sums, n_correct, grad_features, grad_weight


class _Buffer:
    """The weight gradient's buffer when no tied-gradient hub takes it."""

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None

    def add_outer(self, g: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> None:
        if self.buffer is None:
            self.buffer = g.t().mm(x).to(dtype)
        else:
            self.buffer.addmm_(g.t(), x)


class _FusedVocabularyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, weight, target, eps, chunk_tokens, accuracy, grad_scale, hub):
        sums, n_correct, grad_features, grad_weight = fused_pass(
            features, weight, target, eps=eps, chunk_tokens=chunk_tokens, accuracy=accuracy,
            grad_scale=grad_scale, need_features_grad=ctx.needs_input_grad[0],
            need_weight_grad=ctx.needs_input_grad[1],
            weight_grad=hub if ctx.needs_input_grad[1] else None)
        ctx.grad_features, ctx.grad_weight, ctx.hub = grad_features, grad_weight, hub
        if hub is not None:  # the projection's part is complete once backward scales it
            hub.projection_begins()
        ctx.dtypes = (features.dtype, weight.dtype)
        ctx.grad_scale = 1.0 if grad_scale is None else float(grad_scale)
        loss, nll_loss = sums[0].clone(), sums[1].clone()  # separate outputs, not views
        if n_correct is None:
            n_correct = loss.new_zeros(())
        ctx.mark_non_differentiable(nll_loss, n_correct)
        ctx.set_materialize_grads(False)
        return loss, nll_loss, n_correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll, _grad_correct):
        grad_features, grad_weight, hub = ctx.grad_features, ctx.grad_weight, ctx.hub
        ctx.grad_features = ctx.grad_weight = ctx.hub = None  # free them with this node
        if grad_loss is None:
            if hub is not None:
                hub.projection_done()
            return (None,) * 8
        factor = grad_loss / ctx.grad_scale
        # the usual case: grad_output is exactly the scale the gradients already carry
        rescale = bool((factor != 1.0).item())
        if grad_features is not None:
            if rescale:
                grad_features.mul_(factor)
            grad_features = grad_features.to(ctx.dtypes[0])
        if grad_weight is not None and rescale:
            grad_weight.mul_(factor)
        if hub is not None and rescale:
            hub.scale(factor)
        if hub is not None:  # (reduced into the shard here when reduced early)
            hub.projection_done()
        # with a hub the weight gradient is already in the tied buffer: return none here
        return grad_features, grad_weight, None, None, None, None, None, None


def fused_vocabulary_loss(features: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          *, eps: float = 0.0, chunk_tokens: int = 256,
                          accuracy: bool = False, grad_scale: Optional[float] = None,
                          hub=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, nll_loss, n_correct) summed over the N rows of ``features`` (N x dim), against
    ``target`` (N word indices, no padding), with the projection ``weight`` (vocab x dim).
    ``loss`` is differentiable with respect to ``features`` and ``weight``; ``hub``: the tied
    weight's gradient hub (its buffer takes the weight gradient)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if not (torch.is_grad_enabled() and (features.requires_grad or weight.requires_grad)):
        sums, n_correct, _, _ = fused_pass(
            features, weight, target, eps=eps, chunk_tokens=chunk_tokens, accuracy=accuracy,
            grad_scale=None, need_features_grad=False, need_weight_grad=False)
        return sums[0], sums[1], n_correct if accuracy else sums.new_zeros(())
    return _FusedVocabularyLoss.apply(features, weight, target, eps, chunk_tokens, accuracy,
                                      grad_scale, hub)
