"""Adam stepped inside backward (``--fsdp2-step-in-backward``): each parameter as soon as FSDP2 has
reduce-scattered its gradient, which is then freed, so that no whole-model gradient is held.

Why: the sharded gradients are the largest thing a one-GPU run holds after its weights and
moments (NLLB-3.3B with bf16 weights: 6.2 GiB of bf16 gradients). Stepped unit by unit as
backward reduces them, about one unit's gradients are alive at a time (torchtune's and
torchtitan's "optimizer in backward" do the same with one optimizer per parameter).

How: FSDP2 (torch 2.13, ``foreach_reduce``) calls each sharded parameter's
post-accumulate-grad hooks (``Tensor.register_post_accumulate_grad_hook``, public) right after it
sets the parameter's ``.grad`` to its reduce-scattered shard. The hook does to that one gradient
what fairseq's Trainer.train_step does to every gradient after backward, in the same order and
with the same operations: ``multiply_grads`` by fairseq's factor (world size / the batch's
sample size over all ranks: the trainer all-reduces the sample size once the loss is computed,
before backward, the only extra collective), the gradient's local norm for the logged gnorm
(grad_norm.local_norm, as clip_grad_norm would take it), and the optimizer's step of that
parameter alone (adam_stats.StoredMoments.step_parameters: fairseq's Adam on the local shard, or
the row-chunked step with the random streams of the parameter's place). Then ``.grad`` is set to
None; when every parameter of a unit has been stepped, FSDP2's reduce-scatter output is freed.

Gradients FSDP2 does not reduce (the tied embedding's early reduce, tied_grad_reduce.py, sets
its gradient itself) are left to fairseq's own step after backward, which scales, measures and
steps only the gradients still held. The norm fairseq logs (gnorm) is that of all the
gradients, the stepped ones' local norms included, in fairseq's order: the same value.

Why exact: Adam is elementwise per parameter, its step counter and bias corrections are per
parameter, and its learning rate is the one fairseq's scheduler set after the previous update;
the factor is fairseq's (checked against fairseq's own when it multiplies the rest:
``check_factor``). What would need the whole gradient before a step (clipping, several
micro-batches, fp16's overflow skip) is refused before training (settings.
step_in_backward_conflict). A non-finite gradient still stops the run with fairseq's
FloatingPointError, after the parameters were stepped (fairseq's crash.pt then holds them).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from .grad_norm import local_norm, norm_of_local_norms
from .local_shard_step import multiply_grads


class StepInBackward:
    """Steps the parameters of ``optimizer`` (fairseq's, around fairseq's Adam with
    adam_stats.StoredMoments) in backward, between ``arm`` and ``disarm`` (the trainer's
    train_step), once ``set_factor`` gave fairseq's gradient factor for the update."""

    def __init__(self, optimizer):
        self.optimizer, self.adam = optimizer, optimizer.optimizer
        self.places: dict = {}
        place = 0
        for number, group in enumerate(self.adam.param_groups):
            for p in group["params"]:
                place += 1  # as the step counts it: its random streams
                self.places[p] = (number, place)
        layouts = {(id(p.device_mesh), p.placements) if isinstance(p, DTensor) else None
                   for p in self.places}
        if len(layouts) != 1 or None in layouts:
            raise NotImplementedError("the step in backward needs every trained parameter "
                                      "sharded by FSDP2 on one mesh")
        first = next(iter(self.places))
        self.mesh = first.device_mesh
        self.shard_dims = [d for d, pl in enumerate(first.placements) if pl.is_shard()]
        self.factor = None
        self.armed = False
        self.norms: dict = {}  # parameter -> its gradient's local norm, once stepped
        self.handles = [p.register_post_accumulate_grad_hook(self._reduced) for p in self.places]
        optimizer.in_backward = self

    def arm(self) -> None:
        """An update begins: step the gradients FSDP2 reduces, once the factor is set."""
        self.armed, self.factor = True, None
        self.norms.clear()

    def disarm(self) -> None:
        """Backward is over (fairseq takes the norm): gradients reduced from now on (fairseq's
        NanDetector re-running a failed update, validation) are left alone."""
        self.armed = False

    def stepped(self) -> int:
        return len(self.norms)

    def set_factor(self, factor) -> None:
        """fairseq's factor of this update's gradients (world size / total sample size)."""
        if self.factor is not None:
            raise RuntimeError("the step in backward takes one forward and backward per update; "
                               "this task's train_step computed a second loss")
        self.factor = factor

    def _reduced(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        if self.factor is None:
            raise RuntimeError("a gradient was reduced before the update's loss was computed")
        if p in self.norms:
            raise RuntimeError("a parameter's gradient was reduced twice in one update")
        number, place = self.places[p]
        with torch.no_grad():
            pending = self.optimizer.pending_factors()
            multiply_grads([p], self.factor, pending)  # fairseq's multiply_grads, this one
            self.norms[p] = local_norm(p.grad.to_local(), pending or ())
            self.adam.step_parameters([(number, place, p)])
        p.grad = None

    def check_factor(self, c) -> None:
        """fairseq multiplies the gradients still held by ``c``: the factor the stepped ones
        were multiplied by (else they were stepped wrongly: stop)."""
        if self.stepped() and float(c) != float(self.factor):
            raise RuntimeError(f"the step in backward scaled the gradients by "
                               f"{float(self.factor)!r}, fairseq by {float(c)!r}")

    def clip_grad_norm(self, max_norm: float, params) -> torch.Tensor:
        """The norm of all this update's gradients (fairseq's gnorm): the stepped ones' and
        those still held (scaled by fairseq, with the factors pending for 16-bit ones), in the
        optimizer's order. No clipping (settings refuses --clip-norm)."""
        if max_norm > 0:
            raise RuntimeError("the step in backward cannot clip")
        pending = self.optimizer.pending_factors() or ()
        local: list[torch.Tensor] = []
        for p in params:
            norm: Optional[torch.Tensor] = self.norms.get(p)
            if norm is None and p.grad is not None:
                norm = local_norm(p.grad.to_local(), pending)
            if norm is not None:
                local.append(norm)
        return norm_of_local_norms(local, self.mesh, self.shard_dims)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.optimizer.in_backward = None
