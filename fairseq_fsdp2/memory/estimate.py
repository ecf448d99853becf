"""Predicted per-rank peak memory of one training step, without data, devices or allocation.

Pure and analytic. The model is built by fairseq on the ``meta`` device (no memory); the sharding
plan (``plan.build_plan``) gives the FSDP2 units and their parameter shapes; one forward pass on
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
  criterion holds one chunk's fp32 logits (and their 16-bit copy) in forward, creates the weight
  gradient there (with the tied-gradient buffer: the buffer itself), runs no projection in
  backward and never gathers the shared unit in backward;
- backward: the output projection's weight gradient (vocab x dim) stays in autograd's buffer until
  the tied embedding's last use (the encoder embedding); each use of the embedding produces a
  dense vocab x dim gradient that is added to it (3 such tensors alive at once); each layer unit
  is gathered (the previous unit in forward order is prefetched), produces its unsharded
  gradients, and reduce-scatters them through an fp32 input buffer that FSDP2 keeps until the
  next reduce-scatter; the root and shared units reduce-scatter at the end of backward;
- optimizer: sharded parameters, sharded gradients, optimizer state (adam: 2 fp32 tensors, sgd:
  momentum or none) and the update's temporary for the largest shard.

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
"""
from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan import LAYER, ROOT, ShardingPlan, build_plan, layer_candidates

GIB = 1024 ** 3

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
)

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


PRECISIONS = {"fp32": (torch.float32, 4), "fp16": (torch.float16, 2), "bf16": (torch.bfloat16, 2)}
BACKENDS = ("fsdp2", "legacy_ddp")

# -- the model, as data -----------------------------------------------------------------------

@dataclass
class UnitSpec:
    name: str
    kind: str  # ROOT, SHARED or LAYER (plan.py)
    module_paths: tuple[str, ...]
    shapes: list[tuple[int, ...]]
    reshard: object  # plan.Unit.reshard_after_forward

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass
class ForwardTrace:
    """What one forward pass does, in order: ("enter"|"exit", module path) and ("act", bytes)."""

    events: list[tuple[str, object]]
    act_bytes: int
    max_act: dict[str, int]  # layer path -> its largest saved tensor (bytes)


@dataclass
class Workload:
    tokens: int  # tokens per rank per micro-batch (batch x seq_len)
    batch: int
    seq_len: int


@dataclass
class ModelProfile:
    """Everything the simulation needs from the model: units, sizes, the forward trace."""

    units: list[UnitSpec]
    owner: dict[str, str]  # module path (layers, unit modules) -> unit name owning its params
    layer_params: dict[str, int]  # layer path -> number of parameters
    embed_paths: tuple[str, ...]  # modules that look up the tied embedding
    output_paths: tuple[str, ...]  # the output projection
    vocab: int
    embed_dim: int
    total_params: int
    buffer_bytes: int
    plan: ShardingPlan
    trace: ForwardTrace
    workload: Workload
    compute_bytes: int
    traces: dict = field(default_factory=dict)  # device -> ForwardTrace (attention differs)

    def trace_for(self, device: str) -> ForwardTrace:
        return self.traces.get(device, self.trace)


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
    loss_chunk_tokens: int = 0  # 0: the stock criterion
    device: str = "cuda"
    cpu_baseline_gb: Optional[float] = None  # None: cpu_baseline_bytes(vocab)
    cpu_offload: bool = False
    update_freq: int = 1
    no_sync: bool = False
    checkpoint_activations: bool = False
    memory_efficient_fp16: bool = False
    tied_grad_buffer: bool = False  # --fsdp2-tied-grad-buffer: one gradient for all uses


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


# -- building the profile ---------------------------------------------------------------------

class _NoPadding(TorchDispatchMode):
    """Answers the data-dependent ``.any()`` checks fairseq makes on meta tensors ("are there
    padding tokens?") with False: the estimate assumes full batches of equal-length sentences."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default,
                    torch.ops.aten.is_nonzero.default) and args[0].is_meta:
            return False
        return func(*args, **(kwargs or {}))


def unit_specs(model: nn.Module, plan: ShardingPlan) -> list[UnitSpec]:
    """The plan's units with the shapes of the parameters each manages (same rules as plan.py:
    inner units first, a parameter belongs to the first unit that reaches it)."""
    modules = dict(model.named_modules())
    seen: set[int] = set()
    specs = []
    for u in plan.units:
        targets = [model] if u.kind == ROOT else [modules[p] for p in u.module_paths]
        shapes = []
        for m in targets:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    shapes.append(tuple(p.shape) or (1,))
        specs.append(UnitSpec(u.name, u.kind, u.module_paths, shapes, u.reshard_after_forward))
    return specs


def _owners(model: nn.Module, specs: list[UnitSpec]) -> dict[int, str]:
    modules = dict(model.named_modules())
    owner: dict[int, str] = {}
    for s in specs:
        targets = [model] if s.kind == ROOT else [modules[p] for p in s.module_paths]
        for m in targets:
            for p in m.parameters():
                owner.setdefault(id(p), s.name)
    return owner


def _is_attention(module: nn.Module) -> bool:
    """fairseq's MultiheadAttention (and look-alikes)."""
    return all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "out_proj",
                                             "num_heads"))


def trace_forward(model: nn.Module, paths: Iterable[str], workload: Workload,
                  dtype: torch.dtype, features_only: bool) -> ForwardTrace:
    """Run the (meta) model forward once, in train mode, recording module entries and exits
    for ``paths`` and the bytes of every tensor autograd saves (each storage once; parameters
    and buffers excluded).

    Inside attention modules, the tensors saved by the attention itself (not its inputs) are
    recorded as one ("attn", (traced bytes, fused bytes)) event: the trace runs PyTorch's
    reference attention, which saves the batch x heads x L x L probabilities (as CPU does);
    CUDA's fused kernels save q, k, v, the output and the log-sum-exp instead (fused bytes).
    ``resolve`` picks one of the two for a device."""
    model = model.to(dtype)
    model.train()
    modules = dict(model.named_modules())
    exclude = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
    events: list[tuple[str, object]] = []
    seen: dict[int, torch.Tensor] = {}
    max_act: dict[str, int] = {}
    current: list[str] = []
    attention: list[dict] = []

    def pack(t):
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in exclude and key not in seen:
            seen[key] = t
            nbytes = storage.nbytes()
            if attention and key not in attention[-1]["inputs"]:
                attention[-1]["internal"] += nbytes
            else:
                events.append(("act", nbytes))
            if current:
                max_act[current[-1]] = max(max_act.get(current[-1], 0), nbytes)
        return t

    def pre(path):
        def hook(module, args):
            events.append(("enter", path))
            current.append(path)
        return hook

    def post(path):
        def hook(module, args, output):
            events.append(("exit", path))
            current.pop()
        return hook

    def attention_pre(module, args, kwargs):
        names = ("query", "key", "value")
        given = {n: kwargs.get(n, args[i] if i < len(args) else None)
                 for i, n in enumerate(names)}
        query = given["query"]
        key = given["key"] if given["key"] is not None else query
        attention.append({"inputs": {x.untyped_storage()._cdata for x in given.values()
                                     if isinstance(x, torch.Tensor)},
                          "internal": 0, "shape": (query.shape[0], key.shape[0],
                                                   query.shape[1], query.shape[2]),
                          "heads": module.num_heads, "itemsize": query.element_size()})

    def attention_post(module, args, kwargs, output):
        a = attention.pop()
        tq, tk, b, d = a["shape"]
        fused = (3 * tq + 2 * tk) * b * d * a["itemsize"] + b * a["heads"] * tq * 4
        events.append(("attn", (a["internal"], fused)))

    handles = []
    for path in dict.fromkeys(paths):
        m = modules[path]
        handles.append(m.register_forward_pre_hook(pre(path)))
        handles.append(m.register_forward_hook(post(path)))
    for m in modules.values():
        if _is_attention(m):
            handles.append(m.register_forward_pre_hook(attention_pre, with_kwargs=True))
            handles.append(m.register_forward_hook(attention_post, with_kwargs=True))
    b, n = workload.batch, workload.seq_len
    tokens = torch.full((b, n), 4, dtype=torch.long, device="meta")
    lengths = torch.full((b,), n, dtype=torch.long, device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _NoPadding():
            model(tokens, lengths, tokens.clone(), features_only=features_only)
    finally:
        for h in handles:
            h.remove()
    return resolve(ForwardTrace(events, 0, max_act), "cpu", keep_attention=True)


def resolve(trace: ForwardTrace, device: str, keep_attention: bool = False) -> ForwardTrace:
    """The trace with attention events as activations of ``device`` (cpu: the reference
    attention, as traced; cuda: fused attention kernels)."""
    pick = 1 if device == "cuda" else 0
    events = [e if e[0] != "attn" or keep_attention else ("act", e[1][pick])
              for e in trace.events]
    total = sum(v if k == "act" else v[pick] for k, v in events if k in ("act", "attn"))
    out = ForwardTrace(events, total, trace.max_act)
    if hasattr(trace, "recompute"):
        out.recompute = trace.recompute  # type: ignore[attr-defined]
    return out


def workload_for(max_tokens: Optional[int], batch_size: Optional[int], seq_len: int,
                 batch_multiple: int = 8) -> Workload:
    """The largest batch fairseq forms: max_tokens // seq_len sentences, rounded down to
    --required-batch-size-multiple (when there are at least that many), capped by --batch-size."""
    if max_tokens:
        b = max(max_tokens // seq_len, 1)
        if batch_multiple > 1 and b >= batch_multiple:
            b -= b % batch_multiple
        if batch_size:
            b = min(b, batch_size)
    elif batch_size:
        b = batch_size
    else:
        raise ValueError("the estimate needs --max-tokens or --batch-size")
    return Workload(tokens=b * seq_len, batch=b, seq_len=seq_len)


def build_profile(model: nn.Module, workload: Workload, *, precision: str = "fp32",
                  min_params_to_wrap: int = int(1e8), checkpoint_activations: bool = False,
                  no_reshard_after_forward: bool = False, reshard_degree: int = 0,
                  root_reshard: str = "default", chunked_loss: bool = False) -> ModelProfile:
    """The profile of a fairseq encoder-decoder ``model`` (built on the meta device) for one
    micro-batch. ``model`` is not modified."""
    plan = build_plan(model, world_size=2, min_params_to_wrap=min_params_to_wrap,
                      checkpoint_activations=checkpoint_activations,
                      no_reshard_after_forward=no_reshard_after_forward,
                      reshard_degree=reshard_degree, root_reshard=root_reshard)
    specs = unit_specs(model, plan)
    owner_of_param = _owners(model, specs)
    modules = dict(model.named_modules())
    layers = [p for p, _ in layer_candidates(model)]
    owner, layer_params = {}, {}
    for path in layers:
        params = list(modules[path].parameters())
        layer_params[path] = sum(p.numel() for p in params)
        owner[path] = owner_of_param[id(params[0])] if params else ROOT
    for s in specs:
        for path in s.module_paths:
            if s.kind != ROOT:
                owner[path] = s.name

    embed = getattr(getattr(model, "encoder", None), "embed_tokens", None)
    out_proj = getattr(getattr(model, "decoder", None), "output_projection", None)
    if embed is None or out_proj is None:
        raise ValueError("the estimator models fairseq encoder-decoder models "
                         "(encoder.embed_tokens, decoder.output_projection)")
    path_of = {id(m): p for p, m in model.named_modules()}
    embed_paths = tuple(dict.fromkeys(path_of[id(m)] for m in
                                      (embed, getattr(model.decoder, "embed_tokens", embed))))
    output_paths = (path_of[id(out_proj)],)
    vocab, embed_dim = out_proj.weight.shape

    dtype, nbytes = PRECISIONS[precision]
    traced = copy.deepcopy(model)  # meta: free; the cast and hooks stay off the caller's model
    if checkpoint_activations:
        _strip_checkpointing(traced, layers)
    raw = trace_forward(traced, list(owner) + list(embed_paths) + list(output_paths), workload,
                        dtype, features_only=chunked_loss)
    traces = {}
    for device in ("cpu", "cuda"):
        traces[device] = resolve(raw, device)
        if checkpoint_activations:
            traces[device] = _checkpointed(traces[device], layers,
                                           workload.tokens * int(embed_dim) * nbytes)
    total = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return ModelProfile(specs, owner, layer_params, embed_paths, output_paths, int(vocab),
                        int(embed_dim), total, buffers, plan, traces["cpu"], workload, nbytes,
                        traces)


def _strip_checkpointing(model: nn.Module, layers: list[str]) -> None:
    """fairseq's checkpoint_wrapper replaces a layer's forward; trace the plain forward."""
    modules = dict(model.named_modules())
    for path in layers:
        m = modules[path]
        if hasattr(m, "precheckpoint_forward"):
            m.forward = m.precheckpoint_forward


def _checkpointed(trace: ForwardTrace, layers: list[str], input_bytes: int) -> ForwardTrace:
    """With --checkpoint-activations a layer keeps only its input after forward; its full
    activations come back, one layer at a time, when backward recomputes it."""
    events, inside, kept = [], None, {}
    for kind, value in trace.events:
        if kind == "enter" and value in layers and inside is None:
            inside, kept[value] = value, 0
            events.append((kind, value))
            events.append(("act", input_bytes))
        elif kind == "exit" and value == inside:
            inside = None
            events.append((kind, value))
        elif kind == "act" and inside is not None:
            kept[inside] += value
        else:
            events.append((kind, value))
    max_act = dict(trace.max_act)
    for path, nbytes in kept.items():
        max_act[path] = max(max_act.get(path, 0), nbytes)  # recomputed in backward
    out = ForwardTrace(events, sum(v for k, v in events if k == "act"), max_act)
    out.recompute = kept  # type: ignore[attr-defined]
    return out


# -- the simulation ---------------------------------------------------------------------------

class _Ledger:
    """Bytes alive per category; ``moment`` records the largest total seen (with transients)."""

    def __init__(self):
        self.now: Counter = Counter()
        self.peak_total = -1
        self.peak: dict[str, int] = {}
        self.peak_moment = ""

    def add(self, category: str, nbytes: int) -> None:
        self.now[category] += nbytes

    def sub(self, category: str, nbytes: int) -> None:
        self.now[category] -= nbytes

    def moment(self, name: str, **transient: int) -> None:
        snap = Counter(self.now)
        for k, v in transient.items():
            snap[k] += v
        total = sum(snap.values())
        if total > self.peak_total:
            self.peak_total, self.peak_moment = total, name
            self.peak = {k: int(snap.get(k, 0)) for k, _ in CATEGORIES}


def _shard_rows(n: int, shards: int, rank: int) -> tuple[int, int]:
    """(rows on ``rank``, padded rows per rank) when FSDP2 shards dim 0 of size n."""
    chunk = -(-n // shards)
    return max(0, min(chunk, n - rank * chunk)), chunk


def _unit_sizes(unit: UnitSpec, shards: int, rank: int) -> tuple[int, int, int]:
    """(elements on this rank, padded unsharded elements, largest single-param shard)."""
    local = padded = largest = 0
    for shape in unit.shapes:
        rest = math.prod(shape[1:])
        rows, chunk = _shard_rows(shape[0], shards, rank)
        local += rows * rest
        padded += chunk * shards * rest
        largest = max(largest, rows * rest)
    return local, padded, largest


def _optimizer_states(setup: Setup) -> int:
    if setup.optimizer in ("adam", "adamw", "cpu_adam", "nag"):
        return 2 if setup.optimizer != "nag" else 1
    if setup.optimizer == "sgd":
        return 1 if setup.momentum else 0
    if setup.optimizer == "adagrad":
        return 1
    return 2  # unknown: assume Adam-like


class _FSDP2Step:
    """One training step of FSDP2 (torch 2.13) on one rank, simulated on a ledger.

    The all-gather rules it follows: an all-gather writes a flat output buffer, which is copied
    out into the unsharded parameters; in forward (more than one rank) FSDP2 keeps that buffer
    until the next forward copy-out or the end of the model's forward, in backward it frees it
    at once. The backward of a unit prefetches the unit before it in forward order. A unit's
    gradients are copied into an fp32 reduce-scatter input buffer, kept until the next
    reduce-scatter or the end of backward. With one rank, "all-gather" is a copy.
    """

    def __init__(self, profile: ModelProfile, setup: Setup, rank: int):
        self.p, self.s = profile, setup
        self.trace = profile.trace_for(setup.device)
        self.c = profile.compute_bytes
        self.shards = setup.world_size // setup.replicate_degree
        self.units = {u.name: u for u in profile.units}
        self.local, self.padded, self.largest = {}, {}, 0
        for u in profile.units:
            self.local[u.name], self.padded[u.name], big = _unit_sizes(u, self.shards, rank)
            self.largest = max(self.largest, big)
        self.full = {n: self.padded[n] * self.c for n in self.units}
        self.on_device = not (setup.cpu_offload and setup.device == "cuda")
        self.led = _Ledger()
        self.gathered: dict[str, int] = {}
        self.prefetched: dict[str, int] = {}
        self.retained_ag = 0
        self.retained_rs = 0
        self.post_order: list[Optional[str]] = []
        self.reduced: set[str] = set()
        self.no_backward_gather: set[str] = set()  # set_unshard_in_backward(False)
        self.shared = next((u.name for u in profile.units
                            if set(profile.output_paths) & set(u.module_paths)), ROOT)

    # -- FSDP2's operations -------------------------------------------------------------------
    def unshard(self, name: str, why: str, forward: bool) -> None:
        full, have = self.full[name], self.gathered.get(name, 0)
        if have >= full or (not forward and name in self.no_backward_gather):
            return
        led = self.led
        if self.shards == 1:
            led.moment(why, gathered=full - have)
        else:
            ag = self.prefetched.pop(name, 0)
            if not ag:
                ag = full
                led.add("comm", ag)  # all-gather output buffer
            if forward and self.retained_ag:
                led.sub("comm", self.retained_ag)
                self.retained_ag = 0
            led.moment(why, gathered=full - have)  # copy-out: buffer and parameters alive
            if forward:
                self.retained_ag = ag
            else:
                led.sub("comm", ag)
        led.add("gathered", full - have)
        self.gathered[name] = full

    def reshard(self, name: str, keep_fraction: float = 0.0) -> None:
        have = self.gathered.get(name, 0)
        keep = int(self.full[name] * keep_fraction)
        if have > keep:
            self.led.sub("gathered", have - keep)
            self.gathered[name] = keep

    def post_forward(self, name: str) -> None:
        setting = self.units[name].reshard
        if setting is True:
            self.reshard(name)
        elif isinstance(setting, int) and not isinstance(setting, bool) and setting > 1:
            self.reshard(name, 1.0 / setting)
        self.post_order.append(name)

    def prefetch_before(self, name: str) -> None:
        """Backward prefetch: all-gather the unit before ``name`` in post-forward order."""
        idx = next((i for i in range(len(self.post_order) - 1, -1, -1)
                    if self.post_order[i] == name), None)
        if idx is None:
            return
        self.post_order[idx] = None  # this use is consumed
        target = next((self.post_order[j] for j in range(idx - 1, -1, -1)
                       if self.post_order[j] is not None), None)
        if target is None or self.gathered.get(target, 0) >= self.full[target] \
                or target in self.prefetched or target in self.no_backward_gather:
            return
        if self.shards == 1:
            self.unshard(target, f"backward: prefetch {target}", forward=False)
            return
        self.led.moment(f"backward: prefetch {target}", comm=self.full[target])
        self.led.add("comm", self.full[target])
        self.prefetched[target] = self.full[target]

    def reduce_scatter(self, name: str, grad_bytes: int, in_ledger: bool) -> None:
        led = self.led
        led.sub("comm", self.retained_rs)  # the previous input buffer is released first
        self.retained_rs = 0
        rs_input = self.padded[name] * 4
        led.moment(f"backward: reduce-scatter {name}", comm=rs_input,
                   grads=0 if in_ledger else grad_bytes)
        if in_ledger:
            led.sub("grads", grad_bytes)  # unsharded gradients dropped after the copy-in
        led.add("comm", rs_input)
        self.retained_rs = rs_input
        if self.on_device:
            led.add("grads", self.local[name] * 4)
        self.reduced.add(name)
        self.reshard(name)

    # -- the step ---------------------------------------------------------------------------------
    def run(self) -> _Ledger:
        p, s, led, c = self.p, self.s, self.led, self.c
        T, V, d = p.workload.tokens, p.vocab, p.embed_dim
        mixed = c != 4
        sharded = sum(self.local.values()) * 4
        if self.on_device:
            led.add("sharded", sharded)
            led.add("optim", _optimizer_states(s) * sharded)
        led.add("other", p.buffer_bytes)
        if s.update_freq > 1:  # gradients carried over from the earlier micro-batches
            if s.no_sync:
                led.add("grads", sum(self.padded.values()) * (4 if mixed else c))
            elif self.on_device:
                led.add("grads", sharded)
        self.forward()
        if s.loss_chunk_tokens > 0:
            first_accumulated = self.chunked_loss(min(s.loss_chunk_tokens, T))
        else:
            self.stock_loss()
            first_accumulated = False
        self.layers_backward(first_accumulated)
        # end of backward: the root and the units whose inputs need no gradient reduce-scatter
        for name in (ROOT, self.shared):
            if name in self.reduced:
                continue
            held = self.root_grads if name == ROOT else 0
            if name == self.shared:
                held += V * d * c
            rest = max(self.units[name].numel * c - held, 0)
            led.add("grads", rest)
            self.reduce_scatter(name, held + rest, in_ledger=True)
        led.sub("comm", self.retained_rs)
        self.retained_rs = 0
        for name, nbytes in self.prefetched.items():
            led.sub("comm", nbytes)
        self.prefetched = {}
        for name in list(self.gathered):
            self.reshard(name)
        # optimizer step (the update's temporary: one tensor the size of the largest shard)
        led.moment("optimizer step", optim=self.largest * 4 if self.on_device else 0)
        return led

    def forward(self) -> None:
        p, s, led = self.p, self.s, self.led
        to_run: dict[str, set] = {}
        self.unshard(ROOT, "forward: all-gather root", forward=True)
        layer_units = [u.name for u in p.units if u.kind == LAYER]
        for kind, value in self.trace.events:
            if kind == "act":
                led.add("acts", value)
                continue
            name = p.owner.get(value)
            if name is None or name == ROOT or value not in self.units[name].module_paths:
                continue
            if kind == "enter":
                if not to_run.get(name):
                    to_run[name] = set(self.units[name].module_paths)
                self.unshard(name, f"forward: all-gather {name}", forward=True)
                if s.device == "cuda" and name in layer_units:
                    # implicit prefetch: the next layer's all-gather overlaps this layer
                    i = layer_units.index(name)
                    nxt = self.full[layer_units[i + 1]] if i + 1 < len(layer_units) else 0
                    led.moment(f"forward: {name}", comm=nxt)
            else:
                remaining = to_run.get(name, set())
                remaining.discard(value)
                if not remaining and name in to_run:
                    del to_run[name]
                    self.post_forward(name)
        self.post_forward(ROOT)
        for name in list(to_run):  # groups the forward did not complete (chunked loss)
            self.post_forward(name)
        led.sub("comm", self.retained_ag)  # the root's post-forward frees the last buffer
        self.retained_ag = 0
        led.moment("end of forward")

    def stock_loss(self) -> None:
        p, led, c = self.p, self.led, self.c
        T, V, d = p.workload.tokens, p.vocab, p.embed_dim
        float_copy = 4 if c != 4 else 0
        led.moment("loss forward: logits and log-probabilities", loss=T * V * (c + float_copy + 4))
        led.moment("loss backward: log-softmax gradient", loss=3 * T * V * 4)
        led.add("loss", T * V * c)  # the logits' gradient reaches the model output
        self.unshard(self.shared, f"backward: all-gather {self.shared}", forward=False)
        self.prefetch_before(self.shared)
        self.unshard(ROOT, "backward: all-gather root", forward=False)
        led.moment("backward: output projection", grads=V * d * c, acts=T * d * c)
        led.sub("loss", T * V * c)
        led.add("grads", V * d * c)  # the tied weight's gradient, in autograd's buffer

    def chunked_loss(self, n: int) -> bool:
        """The fused chunked loss (criterions/fused.py): each chunk's logits, softmax and
        gradients in forward; backward only scales. The shared unit is gathered for the loss if
        it was resharded after forward, resharded after it, and never gathered in backward."""
        p, led, c = self.p, self.led, self.c
        T, V, d = p.workload.tokens, p.vocab, p.embed_dim
        # the FSDP2 trainer passes fp16's loss scale: gradients in the compute dtype
        led.add("loss", T * d * c * 2)  # the non-padding features and their gradient
        regather = self.gathered.get(self.shared, 0) < self.full[self.shared]
        self.unshard(self.shared, f"loss: all-gather {self.shared}", forward=False)
        chunk = n * V * (4 + (c if c != 4 else 0))  # float32 logits/softmax (+ 16-bit copy)
        led.moment("loss forward: one chunk", loss=chunk)
        led.add("grads", V * d * c)  # the weight gradient (the tied buffer, with it)
        if -(-T // n) > 1:
            led.moment("loss forward: one chunk", loss=chunk)
        led.sub("loss", T * d * c)  # the features; their gradient goes on to the model output
        if regather:
            self.reshard(self.shared)
        self.no_backward_gather.add(self.shared)
        self.unshard(ROOT, "backward: all-gather root", forward=False)
        self.prefetch_before(ROOT)
        led.sub("loss", T * d * c)
        return True  # the weight's gradient exists: each lookup's gradient adds to it

    def layers_backward(self, accumulated: bool) -> None:
        p, led, c = self.p, self.led, self.c
        T, V, d = p.workload.tokens, p.vocab, p.embed_dim
        recompute = getattr(self.trace, "recompute", {})
        self.root_grads = 0
        for kind, value in reversed(self.trace.events):
            if kind == "act":
                led.sub("acts", value)
                continue
            name = p.owner.get(value)
            if kind == "exit":  # this module's backward starts
                if value in p.embed_paths and name is not None:
                    self.unshard(name, f"backward: all-gather {name}", forward=False)
                if value in p.layer_params and name not in (None, ROOT):
                    self.unshard(name, f"backward: all-gather {name}", forward=False)
                    self.prefetch_before(name)
                if value in p.layer_params:
                    led.moment(f"backward: {value}", acts=recompute.get(value, 0)
                               + 2 * self.trace.max_act.get(value, 0) + T * d * c)
            elif value in p.layer_params:  # this layer's backward is over
                n_params = p.layer_params[value]
                led.moment(f"backward: {value} gradients", grads=n_params * c, acts=2 * T * d * c)
                if name in (None, ROOT):
                    self.root_grads += n_params * c
                    led.add("grads", n_params * c)
                elif name not in self.reduced:
                    self.reduce_scatter(name, n_params * c, in_ledger=False)
            elif value in p.embed_paths:
                # stock: each lookup's dense vocab x dim gradient, added to the weight's; with
                # --fsdp2-tied-grad-buffer the rows are added into the one buffer in place
                extra = (0 if self.s.tied_grad_buffer else
                         V * d * c if accumulated else 2 * V * d * c)
                led.moment(f"backward: {value} (embedding gradient)", grads=extra)
                accumulated = True


def simulate_fsdp2(profile: ModelProfile, setup: Setup, rank: int = 0) -> _Ledger:
    return _FSDP2Step(profile, setup, rank).run()


def simulate_ddp(profile: ModelProfile, setup: Setup) -> _Ledger:
    """fairseq's stock legacy_ddp: every rank holds the whole model, its gradients and state."""
    c = profile.compute_bytes
    work, trace = profile.workload, profile.trace_for(setup.device)
    T, V, d = work.tokens, profile.vocab, profile.embed_dim
    P = profile.total_params
    mixed = c != 4
    led = _Ledger()
    led.add("gathered", P * c)  # the full model on every rank
    master = mixed and not setup.memory_efficient_fp16
    if master:
        led.add("sharded", P * 4)  # fairseq's FP16Optimizer: fp32 master copy
    led.add("optim", _optimizer_states(setup) * P * 4)
    led.add("other", profile.buffer_bytes)
    if setup.world_size > 1:
        led.add("comm", P * c)  # LegacyDistributedDataParallel's all-reduce buffer
    if master:
        led.add("grads", P * 4)  # the fp32 master gradients, kept between steps
    float_copy = 4 if mixed else 0
    for kind, value in trace.events:
        if kind == "act":
            led.add("acts", value)
    led.moment("end of forward")
    new = V * d * c  # one dense gradient of the tied weight
    if setup.loss_chunk_tokens <= 0:
        led.moment("loss forward: logits and log-probabilities", loss=T * V * (c + float_copy + 4))
        led.moment("loss backward: log-softmax gradient", loss=3 * T * V * 4)
        led.moment("backward: output projection", loss=T * V * c, grads=new, acts=T * d * c)
        led.add("grads", new)
    else:  # the fused chunked loss; fairseq's own trainer passes no fp16 loss scale, so an
        # fp16 model's loss gradients are float32, computed against a float32 copy of the weight
        n = min(setup.loss_chunk_tokens, T)
        g = 4 if setup.precision == "fp16" else c
        weight_copy = V * d * 4 if setup.precision == "fp16" else 0
        led.add("loss", T * d * (c + g))  # the features and their gradient
        chunk = n * V * (4 + (c if c != 4 else 0)) + weight_copy
        led.moment("loss forward: one chunk", loss=chunk)
        led.add("grads", V * d * g)
        led.moment("loss forward: one chunk", loss=chunk)
        led.sub("loss", T * d * (c + g))
    accumulated = setup.loss_chunk_tokens > 0
    for kind, value in reversed(trace.events):
        if kind == "act":
            led.sub("acts", value)
        elif kind == "exit" and value in profile.layer_params:
            led.moment(f"backward: {value}",
                       acts=2 * trace.max_act.get(value, 0) + T * d * c)
        elif kind == "enter" and value in profile.layer_params:
            n_params = profile.layer_params[value]
            led.moment(f"backward: {value} gradients", grads=n_params * c, acts=2 * T * d * c)
            led.add("grads", n_params * c)
        elif kind == "enter" and value in profile.embed_paths:
            extra = V * d * c if accumulated else 2 * V * d * c
            led.moment(f"backward: {value} (embedding gradient)", grads=extra)
            accumulated = True
    rest = P * c - V * d * c - sum(profile.layer_params.values()) * c
    led.add("grads", max(rest, 0))
    largest = max(math.prod(s) for u in profile.units for s in u.shapes)
    led.moment("optimizer step", optim=largest * 4)
    return led


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
            key = tuple(_unit_sizes(u, shards, r)[0] for u in profile.units)
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
        notes.append("CUDA: caching-allocator peak of allocated tensors (what the memory log "
                     "reports); CUDA context, NCCL buffers and allocator fragmentation not "
                     "included; attention as PyTorch's fused kernels keep it (q, k, v, output, "
                     "log-sum-exp). Validated on CPU only (no GPU on the project's machine)")
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
    return f"{head}, {setup.precision}, {setup.optimizer}, {loss}, {setup.device}"


def format_estimate(est: Estimate) -> str:
    rows = [("category",) + tuple(_ranks_label(c.ranks) for c in est.classes)]
    for key, label in CATEGORIES:
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
