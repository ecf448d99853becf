"""Chunked vocabulary loss: fairseq's cross-entropy criteria without the tokens x vocab logits.

With NLLB's 256,206-word vocabulary the logits, their float log-softmax and the gradients of both
are the largest tensors of a training step (4 bytes x 256,206 = 1 MB per target token, each).
These criteria run the model with ``features_only=True`` and compute the output projection,
log-softmax and loss for ``--loss-chunk-tokens`` target tokens at a time. Each chunk runs under
non-reentrant activation checkpointing: only its loss sums are kept, and its logits are recomputed
in backward, so at most one chunk's vocabulary-sized tensors are alive at any time.

The output projection is called as a module (``model.decoder.output_layer`` calls
``output_projection(x)``), so FSDP2's hooks fire for it, in forward and when a chunk is recomputed
in backward. Under FSDP2 it shares its weight with the embeddings in one grouped unit, and the
per-chunk calls are a partial forward of that group, which FSDP2 supports: the first chunk gathers
the weight, it stays gathered over the chunks and their recomputation, and its gradient is
reduce-scattered once per step, as with the stock criterion. One cost remains: the post-backward
hook FSDP2 puts on the first chunk's input reshards the weight before the decoder's backward,
which gathers it again (one more all-gather of the embedding per step than the stock criterion).

Results are the parent criterion's up to float summation order: the per-chunk losses are the
parent's own formulas (``label_smoothed_nll_loss``, ``F.nll_loss``) on the chunk, and the losses
are sums, so the chunk sums add up to the parent's. ``--loss-chunk-tokens 0``, ``reduce=False``
and adaptive-softmax decoders run the parent criterion unchanged.
"""
# No `from __future__ import annotations`: fairseq reads the config fields' types at runtime.
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
    label_smoothed_nll_loss,
)
from torch.utils.checkpoint import checkpoint

CHUNK_HELP = ("compute the output projection, log-softmax and loss over chunks of this many "
              "target tokens, recomputing each chunk in backward, so the tokens x vocabulary "
              "logits never exist at once; 0: no chunking (the parent criterion)")


def use_chunks(model, chunk_tokens: int, reduce: bool) -> bool:
    return (chunk_tokens > 0 and reduce
            and getattr(model.decoder, "adaptive_softmax", None) is None)


def chunked_sums(model, sample, chunk_loss, chunk_tokens: int, padding_idx: int,
                 ignore_prefix_size: int = 0) -> torch.Tensor:
    """Sum of ``chunk_loss(lprobs, target)`` (a 1-D tensor) over chunks of the sample's
    non-padding target tokens; each chunk is recomputed in backward."""
    net_output = model(**sample["net_input"], features_only=True)
    features, target = net_output[0], model.get_targets(sample, net_output)
    features, target = features[:, ignore_prefix_size:], target[:, ignore_prefix_size:]
    keep = target.ne(padding_idx)
    features, target = features[keep], target[keep]  # N x C, N

    def run(features, target):
        logits = model.decoder.output_layer(features)  # a module call: FSDP2 hooks fire
        lprobs = model.get_normalized_probs((logits, None), log_probs=True)  # float
        return chunk_loss(lprobs, target)

    return sum(checkpoint(run, f, t, use_reentrant=False)
               for f, t in zip(features.split(chunk_tokens), target.split(chunk_tokens)))


def sample_size_of(criterion, sample):
    return sample["target"].size(0) if criterion.sentence_avg else sample["ntokens"]


@dataclass
class LabelSmoothedCrossEntropyChunkedCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    loss_chunk_tokens: int = field(default=1024, metadata={"help": CHUNK_HELP})


@register_criterion("label_smoothed_cross_entropy_chunked",
                    dataclass=LabelSmoothedCrossEntropyChunkedCriterionConfig)
class LabelSmoothedCrossEntropyChunkedCriterion(LabelSmoothedCrossEntropyCriterion):
    """``label_smoothed_cross_entropy`` computed over chunks of target tokens."""

    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, loss_chunk_tokens=1024):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.loss_chunk_tokens = loss_chunk_tokens

    def forward(self, model, sample, reduce=True):
        if not use_chunks(model, self.loss_chunk_tokens, reduce):
            return super().forward(model, sample, reduce=reduce)
        # index, don't unpack (unbind views): fairseq does `loss *= 0` on dummy batches
        sums = chunked_sums(model, sample, self.chunk_loss, self.loss_chunk_tokens,
                            self.padding_idx, self.ignore_prefix_size)
        loss, nll_loss, n_correct, total = sums[0], sums[1], sums[2], sums[3]
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
            logging_output["total"] = int(utils.item(total.data))
        return loss, sample_size, logging_output

    def chunk_loss(self, lprobs, target):
        """[loss, nll_loss, n_correct, total] of one chunk (no padding in it)."""
        loss, nll_loss = label_smoothed_nll_loss(lprobs, target, self.eps,
                                                 ignore_index=self.padding_idx, reduce=True)
        if self.report_accuracy:
            n_correct = lprobs.detach().argmax(-1).eq(target).sum().to(loss.dtype)
        else:
            n_correct = loss.new_zeros(())
        return torch.stack([loss, nll_loss, n_correct, loss.new_tensor(target.numel())])


@dataclass
class CrossEntropyChunkedCriterionConfig(CrossEntropyCriterionConfig):
    loss_chunk_tokens: int = field(default=1024, metadata={"help": CHUNK_HELP})


@register_criterion("cross_entropy_chunked", dataclass=CrossEntropyChunkedCriterionConfig)
class CrossEntropyChunkedCriterion(CrossEntropyCriterion):
    """``cross_entropy`` computed over chunks of target tokens."""

    def __init__(self, task, sentence_avg, loss_chunk_tokens=1024):
        super().__init__(task, sentence_avg)
        self.loss_chunk_tokens = loss_chunk_tokens

    def forward(self, model, sample, reduce=True):
        if not use_chunks(model, self.loss_chunk_tokens, reduce):
            return super().forward(model, sample, reduce=reduce)
        loss = chunked_sums(model, sample, self.chunk_loss, self.loss_chunk_tokens,
                            self.padding_idx)[0]
        sample_size = sample_size_of(self, sample)
        logging_output = {
            "loss": loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output

    def chunk_loss(self, lprobs, target):
        return F.nll_loss(lprobs, target, ignore_index=self.padding_idx, reduction="sum")[None]
