"""The decisions a run's settings make, each in one place: the trainer and the optimizer act on
them, the estimator (estimator/) predicts with them, and none of them states a rule again.

What: pure functions of option values (plain strings, booleans and numbers, so that fairseq's
config, an ``argparse.Namespace`` and the estimator's ``Setup`` all reach them alike):

- ``moment_format``: how Adam's moments are stored between steps (optimizer/build.py,
  adam_stats.py; the formats themselves: optimizer/moments/), from the three flags;
- ``step_takes_16_bit_grads``: whether the optimizer's step can take 16-bit gradient shards
  (optimizer/adam_stats.py, its row-chunked step: fairseq's Adam on local shards, not fp16
  moments, which need their whole tensor's scale, nor amsgrad's third state);
- ``keeps_16_bit_grads``: whether the sharded gradients stay in the 16-bit reduce dtype
  (sharding/sixteen_bit_grads.py, installed by trainer/fsdp2_trainer.py): the step takes them, and
  nothing adds gradients to them (``--update-freq 1``: accumulating over micro-batches would add
  in 16 bits), no ``--cpu-offload``, no ``--fsdp2-fp32-grad-shards``;
- ``row_chunked_step``: whether Adam steps a chunk of rows at a time (optimizer/
  row_chunk_step.py): a step that can take 16-bit gradients, with bf16 or 8-bit moments, 16-bit
  gradients, or a state saved in another format to widen;
- ``step_in_backward_conflict``: why --fsdp2-step-in-backward cannot step Adam inside backward
  exactly as after it (or None where it can): the preflight check refuses the run with it, the
  trainer installs the step where it is None, the estimator models it there.

``sharding/tied_grad_reduce.applies`` (the tied embedding's early reduce) is the same kind of
decision, kept beside the technique it switches. tests/test_settings.py checks that the
estimator's decisions and the runtime's agree over the option combinations and that estimator/
states none of these rules itself.
"""
from __future__ import annotations

from typing import Iterable, Optional

#: Adam's moment formats between steps (--fp16-adam-stats, --bf16-adam-stats,
#: --eight-bit-adam-stats; fp32: fairseq's own): optimizer/moments/ registers one format of
#: each name, and the rules below agree with what each says of itself
#: (tests/test_moment_formats.py)
MOMENT_FORMATS = ("fp32", "fp16", "bf16", "8bit")


def moment_format(fp16: bool, bf16: bool, eight_bit: bool) -> str:
    """Adam's moments between steps, from --fp16-adam-stats (fairseq's flag: first), then
    --bf16-adam-stats, then --eight-bit-adam-stats (the plugin's); ``fp32`` without them."""
    return "fp16" if fp16 else "bf16" if bf16 else "8bit" if eight_bit else "fp32"


def step_takes_16_bit_grads(optimizer: str, moments: str, amsgrad: bool,
                            local_shards: bool = True) -> bool:
    """Whether the optimizer's step takes 16-bit gradient shards (and the factors
    multiply_grads leaves pending for them): fairseq's Adam (``optimizer``: fairseq's name),
    stepped on local shards (``local_shards=False``: the DTensor-dispatch reference), without
    fp16 ``moments`` or ``amsgrad``."""
    return optimizer == "adam" and local_shards and moments != "fp16" and not amsgrad


def keeps_16_bit_grads(reduce_dtype: str, step_takes_them: bool,
                       update_freq: Optional[Iterable[int]], cpu_offload: bool,
                       fp32_grad_shards: bool) -> bool:
    """Whether the sharded gradients stay in the 16-bit ``reduce_dtype`` (--fsdp2-reduce-dtype:
    ``fp32``, ``fp16`` or ``bf16``) for a step that takes them (``step_takes_16_bit_grads``):
    --update-freq 1 (None: fairseq's default, 1), no --cpu-offload, no
    --fsdp2-fp32-grad-shards."""
    return reduce_dtype != "fp32" and step_takes_them and \
        list(update_freq or [1]) == [1] and not cpu_offload and not fp32_grad_shards


def row_chunked_step(step_takes_16_bit: bool, moments: str, narrow_grads: bool,
                     mixed_state: bool = False, bf16_weights: bool = False) -> bool:
    """Whether Adam steps a chunk of rows at a time: a step that takes 16-bit gradients
    (``step_takes_16_bit_grads``) with bf16 or 8-bit ``moments``, with 16-bit gradient shards
    (``narrow_grads``), with a ``mixed_state`` (one loaded in another format) to widen, or with
    ``bf16_weights`` (``keeps_bf16_weights``: the weights widened and rounded back a chunk at a
    time). Otherwise float32 moments step as fairseq's Adam does, and fp16 ones (or amsgrad's) a
    bucket of parameters at a time."""
    return step_takes_16_bit and (moments != "fp32" or narrow_grads or mixed_state or
                                  bf16_weights)


def keeps_bf16_weights(memory_efficient_bf16: bool, step_takes_16_bit: bool) -> bool:
    """Whether the sharded parameters are kept in bf16 with no float32 master copy:
    ``--memory-efficient-bf16`` (fairseq's flag, which implies --bf16), for a step that can take
    them (``step_takes_16_bit_grads``: fairseq's Adam on local shards, its row-chunked step
    widening each chunk of weights to float32 and writing the update back with stochastic
    rounding). Another optimizer (or amsgrad, or fp16 moments) keeps float32 master weights, as
    --bf16 does (the trainer says so)."""
    return memory_efficient_bf16 and step_takes_16_bit


def step_in_backward_conflict(optimizer: str, moments: str, amsgrad: bool, clip_norm: float,
                              update_freq: Optional[Iterable[int]], fp16: bool,
                              cpu_offload: bool, lora_train_new_rows: bool) -> Optional[str]:
    """Why Adam's step cannot run inside backward exactly as fairseq's step after it
    (--fsdp2-step-in-backward: optimizer/step_in_backward.py), or None where it can: fairseq's
    Adam (``optimizer``: fairseq's name) stepped per parameter on its local shard with float32,
    bf16 or 8-bit ``moments`` (not fp16 ones, nor amsgrad's third state: stepped a bucket of
    parameters at a time), each gradient scaled by fairseq's world size / sample size as soon as
    FSDP2 has reduced it. What needs the whole model's gradient before any step refuses it:
    clipping (``clip_norm`` > 0: the global norm), ``update_freq`` > 1 (gradients summed over
    micro-batches), --fp16 / --memory-efficient-fp16 (``fp16``: a loss-scale overflow skips the
    update, known only once every gradient is), --lora-train-new-rows (zeroes rows of the
    embedding's gradient after backward); and --cpu-offload, whose Adam runs on the CPU: inside
    backward it would stall the GPU."""
    if optimizer != "adam":
        return f"steps fairseq's Adam: it needs --optimizer adam, got --optimizer {optimizer}"
    if moments == "fp16":
        return ("cannot step --fp16-adam-stats' moments one parameter at a time (their scale is "
                "a bucket's): use --bf16-adam-stats or --eight-bit-adam-stats")
    if amsgrad:
        return "cannot step Adam's amsgrad one parameter at a time"
    if clip_norm > 0:
        return (f"needs --clip-norm 0, got {clip_norm:g}: clipping scales every gradient by the "
                f"whole model's norm, known only after backward")
    freq = list(update_freq or [1])
    if freq != [1]:
        return (f"needs --update-freq 1, got {','.join(map(str, freq))}: the gradients of "
                f"several micro-batches are summed before the step")
    if fp16:
        return ("cannot be combined with --fp16: an update whose loss-scaled gradients overflow "
                "is skipped, known only after backward (use --bf16)")
    if cpu_offload:
        return ("cannot be combined with --cpu-offload: Adam would run on the CPU inside "
                "backward, the GPU waiting for it")
    if lora_train_new_rows:
        return ("cannot be combined with --lora-train-new-rows, which zeroes the pretrained "
                "rows' gradient after backward")
    return None
