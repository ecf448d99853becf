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
  log-probabilities, the gradient flowing in and the one flowing out); the chunked criterion
  holds the same for ``--loss-chunk-tokens`` tokens at a time;
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
torch, fairseq, gloo, the data loader; ``CPU_BASELINE_GB``, measured on this project's machine)
to the tensors. Steady state: the first update (optimizer-state creation, the full model built
before sharding) is not modelled.
"""
from __future__ import annotations

import contextlib
import copy
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan import LAYER, ROOT, SHARED, ShardingPlan, build_plan, layer_candidates

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

#: Resident memory of a fairseq-train process on CPU before any model tensor: Python, torch,
#: fairseq, the plugin, gloo and the data loader. Measured on the project's machine (Python
#: 3.11.7, torch 2.13.0+cpu, fairseq-fixed 0.12.3.1, MALLOC_MMAP_THRESHOLD_=65536) as peak RSS
#: minus the bytes of live tensors that PyTorch's MemTracker counted over the same update:
#: 0.4335 GiB with --ddp-backend fsdp2 (1 and 2 ranks), 0.429 GiB with legacy_ddp.
CPU_BASELINE_GB = 0.433

PRECISIONS = {"fp32": (torch.float32, 4), "fp16": (torch.float16, 2), "bf16": (torch.bfloat16, 2)}
BACKENDS = ("fsdp2", "legacy_ddp")

#: Autograd adds the gradients of the tied embedding's uses out of place: at each use, the buffer
#: so far, the new dense vocab x dim gradient and their sum are alive together.
EMBED_GRAD_COPIES = 3


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
    cpu_baseline_gb: float = CPU_BASELINE_GB
    cpu_offload: bool = False
    update_freq: int = 1
    no_sync: bool = False
    checkpoint_activations: bool = False
    memory_efficient_fp16: bool = False


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


def trace_forward(model: nn.Module, paths: Iterable[str], workload: Workload,
                  dtype: torch.dtype, features_only: bool) -> ForwardTrace:
    """Run the (meta) model forward once, in train mode, recording module entries and exits
    for ``paths`` and the bytes of every tensor autograd saves (each storage once; parameters
    and buffers excluded)."""
    model = model.to(dtype)
    model.train()
    modules = dict(model.named_modules())
    exclude = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
    events: list[tuple[str, object]] = []
    seen: dict[int, torch.Tensor] = {}
    max_act: dict[str, int] = {}
    current: list[str] = []

    def pack(t):
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in exclude and key not in seen:
            seen[key] = t
            nbytes = storage.nbytes()
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

    handles = []
    for path in dict.fromkeys(paths):
        m = modules[path]
        handles.append(m.register_forward_pre_hook(pre(path)))
        handles.append(m.register_forward_hook(post(path)))
    b, n = workload.batch, workload.seq_len
    tokens = torch.full((b, n), 4, dtype=torch.long, device="meta")
    lengths = torch.full((b,), n, dtype=torch.long, device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _NoPadding():
            model(tokens, lengths, tokens.clone(), features_only=features_only)
    finally:
        for h in handles:
            h.remove()
    return ForwardTrace(events, sum(v for k, v in events if k == "act"), max_act)


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
    trace = trace_forward(traced, list(owner) + list(embed_paths) + list(output_paths), workload,
                          dtype, features_only=chunked_loss)
    if checkpoint_activations:
        trace = _checkpointed(trace, layers, workload.tokens * int(embed_dim) * nbytes)
    total = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return ModelProfile(specs, owner, layer_params, embed_paths, output_paths, int(vocab),
                        int(embed_dim), total, buffers, plan, trace, workload, nbytes)


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


def simulate_fsdp2(profile: ModelProfile, setup: Setup, rank: int = 0) -> _Ledger:
    c = profile.compute_bytes
    shards = setup.world_size // setup.replicate_degree
    trace, work = profile.trace, profile.workload
    T, V, d = work.tokens, profile.vocab, profile.embed_dim
    units = {u.name: u for u in profile.units}
    local, padded, largest = {}, {}, 0
    for u in profile.units:
        local[u.name], padded[u.name], big = _unit_sizes(u, shards, rank)
        largest = max(largest, big)
    gathered_full = {n: padded[n] * c for n in units}
    on_device = not (setup.cpu_offload and setup.device == "cuda")
    mixed = c != 4

    led = _Ledger()
    sharded_bytes = sum(local.values()) * 4
    if on_device:
        led.add("sharded", sharded_bytes)
        led.add("optim", _optimizer_states(setup) * sharded_bytes)
    led.add("other", profile.buffer_bytes)
    if setup.update_freq > 1:  # gradients carried from the earlier micro-batches
        if setup.no_sync:
            led.add("grads", sum(padded.values()) * (4 if mixed else c))
        elif on_device:
            led.add("grads", sharded_bytes)

    gathered: dict[str, int] = {}
    state = {"retained_rs": 0, "prefetched": {}}

    def unshard(name: str, why: str) -> None:
        have = gathered.get(name, 0)
        if have >= gathered_full[name]:
            return
        pre = state["prefetched"].pop(name, 0)
        if pre:
            led.sub("comm", pre)
        # all-gather output buffer and unsharded parameters alive together during copy-out
        led.moment(why, comm=gathered_full[name],
                   gathered=gathered_full[name] - have)
        led.add("gathered", gathered_full[name] - have)
        gathered[name] = gathered_full[name]

    def reshard(name: str, keep_fraction: float = 0.0) -> None:
        have = gathered.get(name, 0)
        keep = int(gathered_full[name] * keep_fraction)
        if have > keep:
            led.sub("gathered", have - keep)
            gathered[name] = keep

    def post_forward(name: str) -> None:
        setting = units[name].reshard
        if setting is True:
            reshard(name)
        elif isinstance(setting, int) and not isinstance(setting, bool) and setting > 0:
            reshard(name, 1.0 / setting)
        post_order.append(name)

    # forward ---------------------------------------------------------------------------------
    post_order: list[str] = []
    to_run: dict[str, set] = {}
    unshard(ROOT, "forward: all-gather root")
    for kind, value in trace.events:
        if kind == "act":
            led.add("acts", value)
            continue
        name = profile.owner.get(value)
        if name is None or name == ROOT or value not in units[name].module_paths:
            continue
        if kind == "enter":
            if not to_run.get(name):
                to_run[name] = set(units[name].module_paths)
            unshard(name, f"forward: all-gather {name}")
            if setup.device == "cuda":  # implicit prefetch: the next unit's all-gather overlaps
                led.moment(f"forward: {name}", comm=_next_layer_bytes(profile, name, gathered_full))
        else:
            remaining = to_run.get(name, set())
            remaining.discard(value)
            if not remaining:
                post_forward(name)
    for name, remaining in to_run.items():  # groups not completed (chunked loss): root finishes
        if remaining:
            to_run[name] = set()
            post_forward(name)
    post_forward(ROOT)
    led.moment("end of forward")

    # loss and the output projection ------------------------------------------------------------
    shared = next((u.name for u in profile.units if
                   set(profile.output_paths) & set(u.module_paths)), ROOT)
    float_copy = 4 if mixed else 0
    if setup.loss_chunk_tokens <= 0:
        led.moment("loss forward: logits and log-probabilities", loss=T * V * (c + float_copy + 4))
        led.moment("loss backward: log-softmax gradient", loss=3 * T * V * 4)
        # backward reaches the model output: root and shared pre-backward
        led.add("loss", T * V * c)  # gradient of the logits
        unshard(ROOT, "backward: all-gather root")
        unshard(shared, f"backward: all-gather {shared}")
        _prefetch(profile, post_order, len(post_order) - 1, state, led, gathered, gathered_full)
        led.moment("backward: output projection", grads=V * d * c, acts=T * d * c)
        led.sub("loss", T * V * c)
        led.add("grads", V * d * c)  # the tied weight's gradient, until its last use
    else:
        n = min(setup.loss_chunk_tokens, T)
        chunks = -(-T // n)
        led.add("loss", T * d * c)  # the non-padding features, kept for the chunks
        unshard(shared, f"loss: all-gather {shared}")
        led.moment("loss forward: one chunk", loss=n * V * (c + float_copy + 4))
        for i in range(chunks):
            # recompute (logits, log-probabilities), then backward of the chunk
            led.moment("loss backward: one chunk", loss=3 * n * V * 4)
            new = V * d * c
            if i == 0:
                led.moment("backward: chunk output projection", loss=n * V * c, grads=new)
                led.add("grads", new)
            else:
                led.moment("backward: chunk output projection", loss=n * V * c,
                           grads=(EMBED_GRAD_COPIES - 1) * new)
        led.sub("loss", T * d * c)
        # the first chunk's post-backward hook reshards the shared unit (its gradient is still in
        # autograd's buffer); backward then reaches the model output
        if units[shared].reshard is True or units[shared].reshard is False:
            reshard(shared)
        unshard(ROOT, "backward: all-gather root")
        _prefetch(profile, post_order, len(post_order) - 1, state, led, gathered, gathered_full)

    # layers, in reverse ----------------------------------------------------------------------
    root_grads = 0
    layer_acts: list[int] = []
    done: set[str] = set()
    recompute = getattr(trace, "recompute", {})
    act_stack: list[int] = []
    events = trace.events
    for kind, value in reversed(events):
        if kind == "act":
            act_stack.append(value)
            led.sub("acts", value)
            continue
        name = profile.owner.get(value)
        if kind == "exit":
            act_stack = []
            if value in profile.embed_paths and name is not None:
                unshard(name, f"backward: all-gather {name}")
            if value in profile.layer_params and name is not None and name != ROOT:
                unshard(name, f"backward: all-gather {name}")
                idx = _last_index(post_order, name)
                if idx is not None:
                    post_order[idx] = None  # consumed
                    _prefetch(profile, post_order, idx, state, led, gathered, gathered_full)
        else:  # enter: this module's backward is over
            if value in profile.layer_params:
                n_params = profile.layer_params[value]
                recomputed = recompute.get(value, 0)
                led.moment(f"backward: {value}", grads=n_params * c,
                           acts=recomputed + 2 * trace.max_act.get(value, 0) + T * d * c)
                if name == ROOT or name is None:
                    root_grads += n_params * c
                    led.add("grads", n_params * c)
                elif name not in done:
                    _reduce_scatter(name, n_params * c, led, state, local, padded, on_device,
                                    in_ledger=False)
                    done.add(name)
                    reshard(name)
            elif value in profile.embed_paths:
                led.moment(f"backward: {value} (embedding gradient)",
                           grads=(EMBED_GRAD_COPIES - 1) * V * d * c)
    # end of backward: the root and shared units reduce-scatter
    for name in (shared, ROOT):
        if name in done:
            continue
        held = V * d * c if name == shared else root_grads
        if name == ROOT and shared == ROOT:
            held = V * d * c + root_grads
        rest = units[name].numel * c - held
        if rest > 0:
            led.add("grads", rest)
            held += rest
        _reduce_scatter(name, held, led, state, local, padded, on_device, in_ledger=True)
        done.add(name)
        reshard(name)
    led.sub("comm", state["retained_rs"])
    state["retained_rs"] = 0
    for name, nbytes in state["prefetched"].items():
        led.sub("comm", nbytes)
    state["prefetched"] = {}
    for name in list(gathered):
        reshard(name)

    # optimizer step ----------------------------------------------------------------------------
    led.moment("optimizer step", optim=largest * 4 if on_device else 0)
    return led


def _next_layer_bytes(profile: ModelProfile, name: str, gathered_full: dict) -> int:
    names = [u.name for u in profile.units if u.kind == LAYER]
    if name in names and names.index(name) + 1 < len(names):
        return gathered_full[names[names.index(name) + 1]]
    return 0


def _last_index(order: list, name: str) -> Optional[int]:
    for i in range(len(order) - 1, -1, -1):
        if order[i] == name:
            return i
    return None


def _prefetch(profile, post_order, idx, state, led, gathered, gathered_full) -> None:
    """FSDP2's backward prefetch: the unit before this one in post-forward order is
    all-gathered now; its output buffer waits until that unit's pre-backward."""
    for j in range(idx - 1, -1, -1):
        target = post_order[j]
        if target is None:
            continue
        if target == ROOT or gathered.get(target, 0) >= gathered_full[target] \
                or target in state["prefetched"]:
            return
        led.moment(f"backward: prefetch {target}", comm=gathered_full[target])
        led.add("comm", gathered_full[target])
        state["prefetched"][target] = gathered_full[target]
        return


def _reduce_scatter(name, grad_bytes, led, state, local, padded, on_device,
                   in_ledger: bool) -> None:
    """Unsharded gradients -> fp32 reduce-scatter input (FSDP2 keeps it until the next
    reduce-scatter) -> this rank's gradient shard. ``grad_bytes``: the unsharded gradients,
    already in the ledger or still transient."""
    led.sub("comm", state["retained_rs"])
    rs_input = padded[name] * 4
    led.moment(f"backward: reduce-scatter {name}", comm=rs_input,
               grads=0 if in_ledger else grad_bytes)
    if in_ledger:
        led.sub("grads", grad_bytes)  # dropped after the copy into the input buffer
    led.add("comm", rs_input)
    state["retained_rs"] = rs_input
    if on_device:
        led.add("grads", local[name] * 4)


def simulate_ddp(profile: ModelProfile, setup: Setup) -> _Ledger:
    """fairseq's stock legacy_ddp: every rank holds the whole model, its gradients and state."""
    c = profile.compute_bytes
    work, trace = profile.workload, profile.trace
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
    if setup.loss_chunk_tokens <= 0:
        led.moment("loss forward: logits and log-probabilities", loss=T * V * (c + float_copy + 4))
        led.moment("loss backward: log-softmax gradient", loss=3 * T * V * 4)
        led.moment("backward: output projection", loss=T * V * c, grads=V * d * c)
    else:
        n = min(setup.loss_chunk_tokens, T)
        led.add("loss", T * d * c)
        led.moment("loss forward: one chunk", loss=n * V * (c + float_copy + 4))
        led.moment("loss backward: one chunk", loss=3 * n * V * 4, grads=V * d * c)
        led.moment("backward: chunk output projection", loss=n * V * c,
                   grads=EMBED_GRAD_COPIES * V * d * c)
        led.sub("loss", T * d * c)
    led.add("grads", V * d * c)
    for kind, value in reversed(trace.events):
        if kind == "act":
            led.sub("acts", value)
        elif kind == "enter" and value in profile.layer_params:
            n_params = profile.layer_params[value]
            led.moment(f"backward: {value}",
                       acts=2 * trace.max_act.get(value, 0) + T * d * c, grads=n_params * c)
            led.add("grads", n_params * c)
        elif kind == "enter" and value in profile.embed_paths:
            led.moment(f"backward: {value} (embedding gradient)",
                       grads=(EMBED_GRAD_COPIES - 1) * V * d * c)
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
    baseline = int(setup.cpu_baseline_gb * GIB) if setup.device == "cpu" else 0
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
                     f"{setup.cpu_baseline_gb:.3f} GiB (Python, torch, fairseq, gloo, data "
                     f"loader), measured on this project's machine")
    else:
        notes.append("CUDA: caching-allocator peak of allocated tensors (what the memory log "
                     "reports); CUDA context, NCCL buffers and allocator fragmentation not included")
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
