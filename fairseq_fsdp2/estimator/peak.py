"""Predicted per-rank peak memory of one training step, without data, devices or allocation.

Pure and analytic. The model is built by fairseq on the ``meta`` device (no memory); the sharding
plan (``sharding/plan.py``) gives the FSDP2 units and their parameter shapes; one forward pass on
meta tensors, with a saved-tensor hook, gives the order in which modules and units run and the
activation bytes autograd keeps (in the compute dtype, at the batch shape). A step is then
*simulated* on a ledger of bytes per category, event by event, the way FSDP2 (torch 2.13) and
fairseq allocate and free, and the largest total is the peak:

- forward: each unit is all-gathered at its first module's pre-forward (all-gather output buffer
  and unsharded parameters both alive during copy-out) and resharded at its post-forward if its
  setting says so (a grouped unit: after its last module; the root: after the whole forward);
- loss: the stock criterion holds the logits (tokens x vocab, compute dtype), their fp32 copy and
  the fp32 log-probabilities in forward, and 3 fp32 tokens x vocab tensors in backward (the saved
  log-probabilities, the gradient flowing in and the one flowing out); the fused chunked
  criterion holds one chunk's logits in forward (16-bit ones widened to fp32 a block of rows at a
  time: criterions/fused.py chunk_bytes), creates the weight
  gradient there (with the tied-gradient buffer: the buffer itself), runs no projection in
  backward and never gathers the shared unit in backward;
- backward: the output projection's weight gradient (vocab x dim) stays in autograd's buffer until
  the tied embedding's last use (the encoder embedding); each use of the embedding produces a
  dense vocab x dim gradient that is added to it (3 such tensors alive at once); each layer unit
  is gathered (the previous unit in forward order is prefetched), produces its unsharded
  gradients, and reduce-scatters them through an fp32 input buffer that FSDP2 keeps until the
  next reduce-scatter; the root and shared units reduce-scatter at the end of backward;
- optimizer: sharded parameters, sharded gradients, optimizer state (adam: 2 fp32 tensors, or
  16-bit ones with --fp16-adam-stats / --bf16-adam-stats, or 8-bit codes with a float32 maximum
  per block of 256 with --eight-bit-adam-stats, fp32 for parameters under 4096 elements; sgd:
  momentum or none) and the update's temporaries for the largest shard (with 16-bit or 8-bit
  moments, a bucket's moments in fp32 too).

fairseq's stock ``legacy_ddp`` is simulated on the same ledger: full fp32 parameters, gradients and
optimizer state on every rank, plus its all-reduce buffer (the size of the model, from 2 ranks).

What "peak" means follows the memory monitor (``memory/monitor.py``): on CUDA, allocator peak
(tensors only); on CPU, the process's peak resident memory, which adds a runtime baseline (Python,
torch, fairseq, gloo, the data loader, the dictionaries; ``cpu_baseline_bytes``, measured on this
project's machine) to the tensors. Attention activations differ by device: the meta trace runs
PyTorch's reference attention, which keeps the batch x heads x L x L probabilities (as CPU does);
on CUDA the fused kernels keep q, k, v, the output and the log-sum-exp instead. Steady state: the
first update (optimizer-state creation, the full model built before sharding) is not modelled.
Batches are full (--max-tokens / --seq-len sentences, rounded down to
--required-batch-size-multiple) and unpadded.

The estimator's modules: ``model_profile.py`` (the model as data: units, forward trace,
workload), ``forward_trace.py`` (the trace itself; a repeated layer's record replayed),
``ledger.py`` (the setup and the ledger), ``fsdp2_step.py`` (FSDP2's step),
``ddp_step.py`` (legacy_ddp's step on the same ledger), ``from_args.py`` (fairseq-train arguments
to a setup and a profile), and this one (the estimate per class of ranks, the CPU baseline, the
printed report).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .ddp_step import simulate_ddp
from .fsdp2_step import simulate_fsdp2
from .ledger import CATEGORIES, OPTIMIZER_STATES, OPTIONAL_CATEGORIES, Setup, unit_sizes
from .model_profile import BACKENDS, ModelProfile, Workload

GIB = 1024 ** 3


#: Resident memory of a fairseq-train process on CPU besides the tensors: Python, torch, fairseq,
#: the plugin, gloo, the data loader and the dictionaries. Measured on the project's machine
#: (Python 3.11.7, torch 2.13.0+cpu, fairseq-fixed 0.12.3.1, MALLOC_MMAP_THRESHOLD_=65536) as
#: peak RSS minus the bytes of the live tensors PyTorch's MemTracker counted in the same update:
#: 0.431 GiB with an 80-symbol dictionary, 0.4335 GiB with 50,000 (1, 2 and 4 ranks; legacy_ddp
#: 0.004 GiB less), 0.4985 GiB with NLLB's 256,206. The translation task loads the source and
#: target dictionaries as two objects, about 170 bytes per symbol each; the first ~40,000 symbols
#: fit in memory the interpreter already holds.
CPU_BASELINE_GB = 0.431
CPU_DICT_BYTES_PER_SYMBOL = 340
CPU_DICT_FREE_SYMBOLS = 40_000


def cpu_baseline_bytes(vocab: int, base_gb: float = CPU_BASELINE_GB) -> int:
    """The CPU runtime baseline of a fairseq-train process with a ``vocab``-symbol dictionary."""
    return int(base_gb * GIB) + max(0, vocab - CPU_DICT_FREE_SYMBOLS) * CPU_DICT_BYTES_PER_SYMBOL


@dataclass
class RankEstimate:
    ranks: list[int]
    peak: int  # bytes
    breakdown: dict[str, int]  # category key -> bytes at the peak moment
    moment: str  # where in the step the peak is

    @property
    def peak_gb(self) -> float:
        return self.peak / GIB


@dataclass
class Estimate:
    setup: Setup
    workload: Workload
    classes: list[RankEstimate]  # rank classes (ranks with identical shard sizes), largest first
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(c.peak for c in self.classes)

    @property
    def peak_gb(self) -> float:
        return self.peak / GIB

    def table(self) -> str:
        return format_estimate(self)


def estimate(profile: ModelProfile, setup: Setup) -> Estimate:
    """Per-rank peak for ``setup``, one entry per class of ranks with equal shard sizes."""
    if setup.backend not in BACKENDS:
        raise ValueError(f"backend {setup.backend!r}: the estimator models {', '.join(BACKENDS)}")
    if setup.world_size % setup.replicate_degree:
        raise ValueError(f"replicate degree {setup.replicate_degree} does not divide world size "
                         f"{setup.world_size}")
    if setup.device != "cpu":
        baseline = 0
    elif setup.cpu_baseline_gb is not None:
        baseline = int(setup.cpu_baseline_gb * GIB)
    else:
        baseline = cpu_baseline_bytes(profile.vocab)
    classes: list[RankEstimate] = []
    if setup.backend == "legacy_ddp":
        groups = {0: list(range(setup.world_size))}
    else:
        shards = setup.world_size // setup.replicate_degree
        groups: dict[tuple, list[int]] = {}
        for r in range(shards):
            key = tuple(unit_sizes(u, shards, r)[0] for u in profile.units)
            groups.setdefault(key, []).append(r)
        groups = {v[0]: [q * shards + r for q in range(setup.replicate_degree) for r in v]
                  for v in groups.values()}
    for rank, ranks in groups.items():
        led = (simulate_ddp(profile, setup) if setup.backend == "legacy_ddp"
               else simulate_fsdp2(profile, setup, rank))
        breakdown = dict(led.peak)
        breakdown["other"] += baseline
        classes.append(RankEstimate(sorted(ranks), led.peak_total + baseline, breakdown,
                                    led.peak_moment))
    classes.sort(key=lambda c: -c.peak)
    notes = []
    if setup.device == "cpu":
        notes.append(f"CPU: peak resident memory (VmHWM); 'other' includes a runtime baseline of "
                     f"{baseline / GIB:.3f} GiB (Python, torch, fairseq, gloo, data loader, "
                     f"dictionaries), measured on this project's machine")
    else:
        attention = ("fairseq's own attention path keeps it (LoRA's adapted projections "
                     "need it: models/lora.py), as traced" if getattr(profile, "lora", None)
                     else "PyTorch's fused kernels keep it (q, k, v, output, log-sum-exp)")
        notes.append("CUDA: caching-allocator peak of allocated tensors (what the memory log "
                     "reports); CUDA context, NCCL buffers and allocator fragmentation not "
                     f"included; attention as {attention}. Validated on CPU only (no GPU on "
                     "the project's machine)")
    if setup.optimizer not in OPTIMIZER_STATES:
        notes.append(f"optimizer {setup.optimizer}: its state is not modelled; counted as "
                     f"Adam's (two fp32 copies of every parameter shard)")
    w = profile.workload
    notes.append(f"batch: {w.batch} sentences x {w.seq_len} tokens = {w.tokens} tokens per "
                 f"rank, no padding; vocabulary {profile.vocab:,}; steady state (update >= 2)")
    return Estimate(setup, profile.workload, classes, notes)


# -- printing ---------------------------------------------------------------------------------

def _ranks_label(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"{len(ranks)} ranks"


def describe_setup(setup: Setup) -> str:
    if setup.backend == "legacy_ddp":
        head = f"legacy_ddp x {setup.world_size}"
    else:
        head = f"fsdp2 x {setup.world_size}"
        if setup.replicate_degree > 1:
            head += f" (replicate {setup.replicate_degree})"
        head += f", root reshard {setup.root_reshard}"
    loss = (f"chunked loss ({setup.loss_chunk_tokens} tokens)" if setup.loss_chunk_tokens > 0
            else "stock loss")
    optimizer = setup.optimizer
    if optimizer == "adam" and setup.adam_stats != "fp32":
        optimizer += f" ({setup.adam_stats} moments)"
    ema = f", EMA {setup.ema_bytes} bytes/parameter" if setup.ema_bytes else ""
    return f"{head}, {setup.precision}, {optimizer}{ema}, {loss}, {setup.device}"


def shown_categories(estimates: list[Estimate]) -> list[tuple[str, str]]:
    """The categories to print: every one, but an optional one that no rank holds."""
    return [(key, label) for key, label in CATEGORIES
            if key not in OPTIONAL_CATEGORIES
            or any(c.breakdown.get(key, 0) for est in estimates for c in est.classes)]


def format_estimate(est: Estimate) -> str:
    rows = [("category",) + tuple(_ranks_label(c.ranks) for c in est.classes)]
    for key, label in shown_categories([est]):
        rows.append((label,) + tuple(f"{c.breakdown.get(key, 0) / GIB:.3f}" for c in est.classes))
    rows.append(("peak per rank (GiB)",) + tuple(f"{c.peak_gb:.3f}" for c in est.classes))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"predicted per-rank peak: {describe_setup(est.setup)}"]
    for i, r in enumerate(rows):
        lines.append("  ".join([r[0].ljust(widths[0])] +
                               [v.rjust(w) for v, w in zip(r[1:], widths[1:])]).rstrip())
        if i == 0 or i == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    for c in est.classes:
        lines.append(f"peak of {_ranks_label(c.ranks)}: {c.moment}")
    lines.extend(f"note: {n}" for n in est.notes)
    return "\n".join(lines)


#: format_summary's column names, where not the category's key
SHORT_LABELS = {"loss": "logits", "ema": "EMA"}


def format_summary(estimates: list[Estimate]) -> str:
    """One row per world size: the largest rank class's peak and breakdown."""
    keys = [key for key, _ in shown_categories(estimates)]
    rows = [("ranks", "peak/rank GiB",
             *(SHORT_LABELS.get(key, key) for key in keys), "peak at")]
    for est in estimates:
        top = est.classes[0]
        b = top.breakdown
        rows.append((str(est.setup.world_size), f"{top.peak_gb:.2f}",
                     *(f"{b[k] / GIB:.2f}" for k in keys), top.moment))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"predicted per-rank peak (largest rank class): "
             f"{describe_setup(estimates[0].setup).replace(' x 1,', ',')}"]
    for i, r in enumerate(rows):
        lines.append("  ".join(v.rjust(w) if j < len(r) - 1 else v
                               for j, (v, w) in enumerate(zip(r, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.extend(f"note: {n}" for n in estimates[0].notes)
    return "\n".join(lines)
