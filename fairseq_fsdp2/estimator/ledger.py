"""The estimator's ledger: the run's setup, and bytes alive per category through a simulated
step (fsdp2_step.py, ddp_step.py), with the largest total seen."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from .. import settings
from ..optimizer import moments
from ..optimizer.adam_stats import BUCKET_MIN
from ..optimizer.moments.format import MOMENTS, MomentFormat
from ..optimizer.row_chunk_step import STEP_CHUNK
from .model_profile import UnitSpec


#: Categories of the breakdown, in print order (key, label).
CATEGORIES = (
    ("sharded", "sharded parameters"),
    ("gathered", "gathered parameters"),
    ("grads", "gradients"),
    ("optim", "optimizer state"),
    ("acts", "activations"),
    ("loss", "logits/loss temporaries"),
    ("comm", "communication buffers"),
    ("other", "other"),
    ("ema", "EMA (--store-ema)"),
)
#: categories printed only when some rank holds bytes of them
OPTIONAL_CATEGORIES = frozenset({"ema"})


@dataclass
class Setup:
    """The run's options that change memory (fairseq-train flags, in plain values)."""

    backend: str = "fsdp2"
    world_size: int = 1
    replicate_degree: int = 1
    precision: str = "fp32"
    root_reshard: str = "default"
    no_reshard_after_forward: bool = False
    reshard_degree: int = 0
    optimizer: str = "adam"
    momentum: float = 0.0
    amsgrad: bool = False  # Adam's amsgrad (fairseq's Adam takes it; no flag sets it)
    loss_chunk_tokens: int = 0  # 0: the stock criterion
    device: str = "cuda"
    cpu_baseline_gb: Optional[float] = None  # None: cpu_baseline_bytes(vocab)
    cpu_offload: bool = False
    update_freq: int = 1
    no_sync: bool = False
    checkpoint_activations: bool = False
    memory_efficient_fp16: bool = False
    tied_grad_buffer: bool = False  # --fsdp2-tied-grad-buffer: one gradient for all uses
    adam_stats: str = "fp32"  # Adam's moments between steps: fp16/bf16 (--fp16/--bf16-adam-stats),
    # 8bit (--eight-bit-adam-stats)
    ema_bytes: int = 0  # --store-ema: bytes of the EMA per parameter element (0: no EMA)
    reduce_dtype: str = "fp32"  # --fsdp2-reduce-dtype: fp32, or the 16-bit compute dtype
    # the sharded gradients stay in the 16-bit reduce dtype for the optimizer (sharding/
    # sixteen_bit_grads.py; settings.keeps_16_bit_grads decides: narrow_grads_of in from_args.py)
    narrow_grads: bool = False
    # the tied embedding's gradient reduced early into the shard, the lookups' rows exchanged
    # (sharding/tied_grad_reduce.py; its ``applies`` decides, setup_for in from_args.py)
    tied_early_reduce: bool = False
    # the sharded parameters stored in bf16 with no fp32 master copy, and so their gradient
    # shards (--memory-efficient-bf16 with Adam: settings.keeps_bf16_weights decides,
    # bf16_weights_of in from_args.py)
    bf16_weights: bool = False
    # Adam stepped per parameter inside backward, each gradient shard freed once stepped
    # (--fsdp2-step-in-backward: settings.step_in_backward_conflict decides, step_in_backward_of
    # in from_args.py; optimizer/step_in_backward.py)
    step_in_backward: bool = False


class Ledger:
    """Bytes alive per category; ``moment`` records the largest total seen (with transients)."""

    def __init__(self):
        self.now: Counter = Counter()
        self.peak_total = -1
        self.peak: dict[str, int] = {}
        self.peak_moment = ""
        self.max: Counter = Counter()  # each category's largest value at any moment

    def add(self, category: str, nbytes: int) -> None:
        self.now[category] += nbytes

    def sub(self, category: str, nbytes: int) -> None:
        self.now[category] -= nbytes

    def moment(self, name: str, **transient: int) -> None:
        snap = Counter(self.now)
        for k, v in transient.items():
            snap[k] += v
        total = sum(snap.values())
        for k, v in snap.items():
            self.max[k] = max(self.max[k], v)
        if total > self.peak_total:
            self.peak_total, self.peak_moment = total, name
            self.peak = {k: int(snap.get(k, 0)) for k, _ in CATEGORIES}


def shard_rows(n: int, shards: int, rank: int) -> tuple[int, int]:
    """(rows on ``rank``, padded rows per rank) when FSDP2 shards dim 0 of size n."""
    chunk = -(-n // shards)
    return max(0, min(chunk, n - rank * chunk)), chunk


def unit_sizes(unit: UnitSpec, shards: int, rank: int) -> tuple[int, int, int]:
    """(elements on this rank, padded unsharded elements, largest single-param shard)."""
    local = padded = largest = 0
    for shape in unit.shapes:
        rest = math.prod(shape[1:])
        rows, chunk = shard_rows(shape[0], shards, rank)
        local += rows * rest
        padded += chunk * shards * rest
        largest = max(largest, rows * rest)
    return local, padded, largest


#: Optimizers whose state the simulator counts: fp32 copies of each parameter (shard) kept.
#: Any other is counted as Adam (two), and the estimate says so (peak.py).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "cpu_adam": 2, "nag": 1, "adagrad": 1, "sgd": 1}


def optimizer_states(setup: Setup) -> int:
    if setup.optimizer == "sgd" and not setup.momentum:
        return 0
    return OPTIMIZER_STATES.get(setup.optimizer, 2)


def adam_moments(setup: Setup) -> Optional[MomentFormat]:
    """The format of fairseq's Adam's moments between steps (optimizer/moments/: what the
    optimizer stores them as), None for another optimizer."""
    return moments.named(setup.adam_stats) if setup.optimizer == "adam" else None


def state_bytes(setup: Setup) -> int:
    """Bytes per element of each optimizer state tensor where that is the same for every
    parameter: fairseq's Adam's moments take their format's (16 bits: 2), every other
    optimizer's states float32 (and 8-bit moments' are counted by shape)."""
    fmt = adam_moments(setup)
    return fmt.element_bytes if fmt is not None and fmt.element_bytes else 4


def optimizer_state_bytes(setup: Setup, elements: int, shapes=(), shards: int = 1,
                          rank: int = 0) -> int:
    """The optimizer state kept for ``elements`` parameter elements; with moments whose bytes
    depend on the parameter's shape (8 bits), for this ``rank``'s dim-0 shards (of
    ``shards``) of parameters of ``shapes``."""
    fmt = adam_moments(setup)
    if fmt is not None and fmt.element_bytes is None:
        return len(MOMENTS) * sum(
            fmt.moment_bytes(shape, shard_rows(shape[0], shards, rank)[0]) for shape in shapes)
    return optimizer_states(setup) * state_bytes(setup) * elements


def row_chunked(setup: Setup) -> bool:
    """Whether fairseq's Adam steps a chunk of rows at a time (optimizer/row_chunk_step.py):
    the optimizer's rule, settings.row_chunked_step."""
    return settings.row_chunked_step(
        settings.step_takes_16_bit_grads(setup.optimizer, setup.adam_stats, setup.amsgrad),
        setup.adam_stats, setup.narrow_grads, bf16_weights=setup.bf16_weights)


def weight_bytes(setup: Setup) -> int:
    """Bytes per element of a trained parameter's shard, and of its gradient shard where not
    kept in the 16-bit reduce dtype: 2 with bf16 weights (FSDP2 keeps a gradient in its
    parameter's dtype), else 4 (the fp32 master shards)."""
    return 2 if setup.bf16_weights else 4


def step_temporary_bytes(setup: Setup, largest: int, total: int, buckets: bool = True) -> int:
    """Bytes alive during the optimizer step on top of the state; ``largest``: the elements of
    the largest (shard of a) parameter, ``total``: of all of them.

    Stepped a chunk of rows at a time (row_chunked; at most STEP_CHUNK elements a call): the
    chunk's moments widened to float32 (8 bytes per element; none for float32 moments, stepped
    where they are: the format's widened_bytes), its 16-bit gradient widened (4), bf16 weights'
    rows widened (4) and Adam's float32 denominator (4), or, once Adam is done, in its place
    the narrowing's temporaries (the format's narrow_bytes: bf16's random integers, 4, or 8
    bits' quantization of a chunk; the weights' stochastic rounding: bf16's). Otherwise: one float32 temporary of the largest parameter (Adam's denominator);
    with fp16 moments (fairseq's scale is the whole tensor's maximum), a bucket's moments
    widened to float32 as well (optimizer/adam_stats.py: at most max(largest, BUCKET_MIN)
    elements and no more than there are, small parameters' 16-bit moments kept, a large one's
    released): 8 bytes per element. ``buckets=False``: stock fairseq's FusedAdamV1, one
    parameter at a time."""
    if buckets and row_chunked(setup):
        fmt, n = adam_moments(setup), min(STEP_CHUNK, total)
        wide_grads = setup.narrow_grads or setup.bf16_weights
        widened = len(MOMENTS) * fmt.widened_bytes + (4 if wide_grads else 0) + \
            (4 if setup.bf16_weights else 0)
        narrowing = fmt.narrow_bytes(n)
        if setup.bf16_weights:
            narrowing = max(narrowing, moments.named("bf16").narrow_bytes(n))
        return widened * n + max(4 * n, narrowing)
    if state_bytes(setup) == 4:
        return 4 * largest
    return 8 * (min(max(largest, BUCKET_MIN), total) if buckets else largest)
