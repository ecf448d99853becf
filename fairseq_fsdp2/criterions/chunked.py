"""Chunked vocabulary loss: fairseq's cross-entropy criteria without the tokens x vocab logits.

With NLLB's 256,206-word vocabulary the logits, their float log-softmax and the gradients of both
are the largest tensors of a training step (4 bytes x 256,206 = 1 MB per target token, each).
These criteria run the model with ``features_only=True`` and hand the decoder features to
``fused.fused_vocabulary_loss``, which computes the output projection, log-softmax, loss and
their gradients ``--loss-chunk-tokens`` target tokens at a time in forward, frees each chunk's
logits at once, and leaves backward only a scaling of the stored gradients: no logits are
recomputed and no second projection runs.

Under FSDP2 the projection weight is the shared embedding's (one grouped unit). It is used here
directly, not through the module call: after the model's forward it is still gathered (root
``default``) or is gathered once for the loss and resharded after it (root ``always``). Nothing
in the unit's backward needs the weight any more (the loss's backward only scales, an
embedding's backward only adds rows), so the unit is told not to gather it in backward
(``set_unshard_in_backward(False)``, FSDP2's public switch for embedding-only units): the
shared embedding is all-gathered as often as with the stock criterion (root default: once per
step; always: twice), and its gradient is reduce-scattered once per step. With
``--fsdp2-tied-grad-buffer`` the weight gradient goes straight into the tied buffer.

Results are the parent criterion's up to float rounding (the same formulas, summed chunk by
chunk: see fused.py). ``--loss-chunk-tokens 0``, ``reduce=False``, adaptive-softmax decoders and
projections other than a bias-free ``nn.Linear`` run the parent criterion unchanged.
"""
# No `from __future__ import annotations`: fairseq reads the config fields' types at runtime.
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .fused import fused_vocabulary_loss

#: From the chunk-size sweep (docs/benchmarks.md, scripts/benchmark_loss.py): on the NLLB-shaped
#: model 64 to 4096 tokens ran at the same words/s within run-to-run noise (all 1.6-1.8x the
#: stock loss), while each token of a chunk holds one vocabulary-sized row of logits (1 MiB at
#: 256,206 words in fp32, half that in 16 bits, whose float32 log-softmax fused.py computes a
#: block of rows at a time): 256 keeps them at 0.25 GiB at most, with chunks large enough for
#: GPU matmuls.
DEFAULT_CHUNK_TOKENS = 256
CHUNK_HELP = ("compute the output projection, log-softmax, loss and their gradients over chunks "
              "of this many target tokens in one pass, so the tokens x vocabulary logits never "
              "exist at once and backward recomputes nothing; 0: no chunking (the parent "
              "criterion)")


def use_chunks(model, chunk_tokens: int, reduce: bool) -> bool:
    decoder = model.decoder
    projection = getattr(decoder, "output_projection", None)
    return (chunk_tokens > 0 and reduce
            and getattr(decoder, "adaptive_softmax", None) is None
            and isinstance(projection, nn.Linear) and projection.bias is None)


def _weight_only_unit(model: nn.Module, weight: torch.Tensor) -> bool:
    """Whether every FSDP2 module holding ``weight`` holds nothing else (its unit then needs
    no parameter in backward once the loss computes its gradients in forward)."""
    holders = [m for m in model.modules() if isinstance(m, FSDPModule)
               and any(p is weight for p in m.parameters(recurse=False))]
    return bool(holders) and all(p is weight for m in holders for p in m.parameters())


@contextmanager
def projection_weight(model):
    """(weight, tied-gradient hub or None) of the output projection, gathered under FSDP2."""
    projection = model.decoder.output_projection
    owner = next((m for m in (projection, model) if isinstance(m, FSDPModule)), None)
    gathered = False
    if isinstance(projection.weight, DTensor) and owner is not None:
        owner.unshard()  # resharded after forward (root always): gather it for the loss
        gathered = True
    weight = projection.weight
    if isinstance(projection, FSDPModule):
        projection.set_unshard_in_backward(not _weight_only_unit(model, weight))
    hub = None
    tied = getattr(projection, "tied_gradient", None)  # --fsdp2-tied-grad-buffer
    if tied is not None and torch.is_grad_enabled() and weight.requires_grad:
        weight, hub = tied.alias(weight)
    try:
        yield weight, hub
    finally:
        if gathered:
            owner.reshard()


def restore_backward_gather(model) -> None:
    """The parent criterion's projection needs the weight in backward: let FSDP2 gather it."""
    projection = getattr(model.decoder, "output_projection", None)
    if isinstance(projection, FSDPModule):
        projection.set_unshard_in_backward(True)


def fused_sums(criterion, model, sample, *, eps: float = 0.0, accuracy: bool = False,
               ignore_prefix_size: int = 0):
    """(loss, nll_loss, n_correct, total) of the sample's non-padding target tokens."""
    net_output = model(**sample["net_input"], features_only=True)
    features, target = net_output[0], model.get_targets(sample, net_output)
    features, target = features[:, ignore_prefix_size:], target[:, ignore_prefix_size:]
    keep = target.ne(criterion.padding_idx)
    features, target = features[keep], target[keep]  # N x C, N
    with projection_weight(model) as (weight, hub):
        loss, nll_loss, n_correct = fused_vocabulary_loss(
            features, weight, target, eps=eps, chunk_tokens=criterion.loss_chunk_tokens,
            accuracy=accuracy, grad_scale=criterion.loss_scale, hub=hub)
    return loss, nll_loss, n_correct, target.numel()


def sample_size_of(criterion, sample):
    return sample["target"].size(0) if criterion.sentence_avg else sample["ntokens"]


@dataclass
class LabelSmoothedCrossEntropyChunkedCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    loss_chunk_tokens: int = field(default=DEFAULT_CHUNK_TOKENS, metadata={"help": CHUNK_HELP})


@register_criterion("label_smoothed_cross_entropy_chunked",
                    dataclass=LabelSmoothedCrossEntropyChunkedCriterionConfig)
class LabelSmoothedCrossEntropyChunkedCriterion(LabelSmoothedCrossEntropyCriterion):
    """``label_smoothed_cross_entropy`` computed over chunks of target tokens."""

    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, loss_chunk_tokens=DEFAULT_CHUNK_TOKENS):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.loss_scale = None  # fp16: the trainer's loss scale (see fused.py)

    def forward(self, model, sample, reduce=True):
        if not use_chunks(model, self.loss_chunk_tokens, reduce):
            restore_backward_gather(model)
            return super().forward(model, sample, reduce=reduce)
        # separate tensors, not views: fairseq does `loss *= 0` on dummy batches
        loss, nll_loss, n_correct, total = fused_sums(
            self, model, sample, eps=self.eps, accuracy=self.report_accuracy,
            ignore_prefix_size=self.ignore_prefix_size)
        sample_size = sample_size_of(self, sample)
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if self.report_accuracy:
            logging_output["n_correct"] = int(utils.item(n_correct.data))
            logging_output["total"] = total
        return loss, sample_size, logging_output


@dataclass
class CrossEntropyChunkedCriterionConfig(CrossEntropyCriterionConfig):
    loss_chunk_tokens: int = field(default=DEFAULT_CHUNK_TOKENS, metadata={"help": CHUNK_HELP})


@register_criterion("cross_entropy_chunked", dataclass=CrossEntropyChunkedCriterionConfig)
class CrossEntropyChunkedCriterion(CrossEntropyCriterion):
    """``cross_entropy`` computed over chunks of target tokens."""

    def __init__(self, task, sentence_avg, loss_chunk_tokens=DEFAULT_CHUNK_TOKENS):
        super().__init__(task, sentence_avg)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.loss_scale = None  # fp16: the trainer's loss scale (see fused.py)

    def forward(self, model, sample, reduce=True):
        if not use_chunks(model, self.loss_chunk_tokens, reduce):
            restore_backward_gather(model)
            return super().forward(model, sample, reduce=reduce)
        loss = fused_sums(self, model, sample)[0]
        sample_size = sample_size_of(self, sample)
        logging_output = {
            "loss": loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output
