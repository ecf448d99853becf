"""The sharding plan: which modules become FSDP2 units, with what reshard setting.

Pure: it reads the model's structure and the options and returns data. No collectives, so it is
unit-testable in one process; ``units.py`` turns a plan into ``fully_shard`` calls.

Policy (all of it lives here):
- fairseq's ``--min-params-to-wrap N``: each transformer layer (an element of a ``layers``
  ModuleList) with >= N parameters becomes its own unit. ``--checkpoint-activations`` makes
  it 0, as fairseq does.
- Modules that share a parameter (the NLLB embedding: encoder input, decoder input, output
  projection) form one grouped unit. Splitting them would untie the weight.
- Everything else stays in the root unit.
- Entry modules: fairseq's tasks and criteria call parts of a model on their own, outside the
  root's ``forward`` (``model.encoder``/``model.decoder`` in translation_moe, each
  ``FairseqMultiModel.models[pair]`` in multilingual_translation). The root's children that
  hold parameters are entries (a container child, a ModuleDict or ModuleList with no forward of
  its own, gives its children instead); a call of one while the root's forward is not running
  goes through the root unit's FSDP2 forward hooks (``units.route_direct_calls``), so the
  root's parameters are gathered for it and its gradients reduced after backward, as for a call
  of the root itself. Entries that are units themselves gather their own parameters.
- A module reachable under several paths (an encoder shared by several language pairs, a
  module each layer holds a reference to) must lie in one unit: one that several units would
  hold stops the run at start (``PlanError``), naming it.
- LoRA (``--lora-rank``, models/lora.py): the units are the same; the plan records which
  parameters train (the adapters and --lora-train-params) and the dtype the frozen rest is
  stored in (the compute dtype: no fp32 master copy of weights that never change; FSDP2
  requires one dtype only of a unit's trainable parameters, so frozen 16-bit and fp32 adapters
  share a unit, all-gathered in the compute dtype). Frozen parameters get no gradient, so no
  reduce-scatter and no optimizer state.
- Reshard after forward: layer units follow ``--no-reshard-after-forward`` or
  ``--fsdp2-reshard-degree``; the root and the shared-embedding unit follow
  ``--fsdp2-root-reshard`` (they are used at both ends of forward and backward).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn as nn

from ..errors import FSDP2Error
from ..models import lora

ReshardSetting = Union[bool, int, None]

ROOT = "root"
SHARED = "shared"
LAYER = "layer"


class PlanError(FSDP2Error, ValueError):
    """The model cannot be sharded as asked (e.g. a tie that crosses a layer unit)."""


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` call: its modules (by path), the parameters it manages, its setting."""

    name: str
    kind: str  # ROOT, SHARED or LAYER
    module_paths: tuple[str, ...]
    num_params: int
    reshard_after_forward: ReshardSetting  # None: PyTorch decides (False for the root)


@dataclass(frozen=True)
class LoraPlan:
    """What LoRA changes in a plan: which parameters train, what the frozen rest is stored in."""

    rank: int
    adapted_modules: int
    adapter_params: int  # elements of lora_A/lora_B
    trained_params: int  # elements trained in full beside them (--lora-train-params)
    frozen_params: int
    frozen_dtype: Optional[torch.dtype]  # None: as built (fp32)

    def describe(self) -> str:
        dtype = str(self.frozen_dtype or torch.float32).replace("torch.", "")
        return (f"LoRA rank {self.rank}: {self.adapted_modules} linear modules adapted, "
                f"{self.adapter_params:,} adapter parameters (fp32, trained), "
                f"{self.trained_params:,} more trained in full, {self.frozen_params:,} frozen "
                f"(stored in {dtype}: no gradient, no optimizer state)")


@dataclass
class ShardingPlan:
    units: list[Unit]  # inner units first, the root last (the order of fully_shard calls)
    total_params: int
    world_size: int
    min_params_to_wrap: int
    warnings: list[str] = field(default_factory=list)
    #: modules a task may call on their own: such calls gather the root unit (module docstring)
    entries: tuple[str, ...] = ()
    #: --lora-rank: the trained and frozen parameters (None: everything trains)
    lora: Optional[LoraPlan] = None

    @property
    def root(self) -> Unit:
        return self.units[-1]

    @property
    def layer_units(self) -> list[Unit]:
        return [u for u in self.units if u.kind == LAYER]

    def table(self) -> str:
        """The plan as a text table, one row a unit (its ``warnings`` are for the caller to
        say, once, at warning level)."""
        rows = [("unit", "modules", "params", "% model", "reshard after forward")]
        for u in self.units:
            modules = ", ".join(u.module_paths) if u.kind != ROOT else "(everything else)"
            if len(modules) > 60:
                modules = modules[:57] + "..."
            pct = 100.0 * u.num_params / max(self.total_params, 1)
            rows.append((u.name, modules, f"{u.num_params:,}", f"{pct:.1f}",
                         describe_reshard(u.reshard_after_forward, u.kind)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.entries:
            lines.append("called on their own outside the root's forward (then gathered with "
                         "the root unit): " + ", ".join(self.entries))
        if self.lora is not None:
            lines.append(self.lora.describe())
        head = (f"FSDP2 sharding plan: {len(self.units)} units over {self.world_size} rank(s), "
                f"{self.total_params:,} parameters, --min-params-to-wrap {self.min_params_to_wrap:,}")
        return "\n".join([head] + lines)


def describe_reshard(setting: ReshardSetting, kind: str) -> str:
    if setting is None:
        return "False (PyTorch default for the root)" if kind == ROOT else "True (default)"
    if setting is True or setting is False:
        return str(setting)
    return f"to groups of {setting} ranks"


def layer_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules fairseq would pass to ``fsdp_wrap``: elements of ``layers`` ModuleLists.
    Their children, not their iteration: iterating fairseq's LayerDropModuleList (layerdrop) in
    training mode yields a random subset of the layers."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and path.rsplit(".", 1)[-1] == "layers":
            found.extend((f"{path}.{i}", layer) for i, layer in module.named_children())
    return found


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Groups of module paths whose modules hold the same Parameter object directly.

    A module reachable under several paths (``encoder.embed_tokens is decoder.embed_tokens``)
    appears once, under its first path.
    """
    first_path: dict[int, str] = {}
    holders: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        mpath = first_path.setdefault(id(module), path)
        for p in module._parameters.values():
            if p is not None and mpath not in holders.setdefault(id(p), []):
                holders[id(p)].append(mpath)
    # merge parameter-level holder lists that share a module into module groups
    groups: list[list[str]] = []
    for paths in holders.values():
        if len(paths) < 2:
            continue
        merged = [g for g in groups if set(g) & set(paths)]
        new = sorted(set(paths).union(*map(set, merged)))
        groups = [g for g in groups if g not in merged] + [new]
    return sorted(groups)


def entry_modules(model: nn.Module) -> list[str]:
    """The paths of the modules a task may call on their own (module docstring): the root's
    children holding parameters; a container child's children in its place."""
    found = []
    for name, child in model.named_children():
        inner = (child.named_children() if isinstance(child, (nn.ModuleDict, nn.ModuleList))
                 else [(None, child)])
        for sub, module in inner:
            if next(module.parameters(), None) is not None:
                found.append(name if sub is None else f"{name}.{sub}")
    return found


def check_shared_modules(model: nn.Module, unit_of_path: dict[str, str]) -> None:
    """A module object reachable under several paths must lie in one unit: the unit of a path
    is its nearest enclosing unit module (by identity, so a shared encoder's layers, one unit
    each, are the same units under every path). ``unit_of_path``: each unit module's path ->
    its unit's name. PlanError naming the module otherwise."""
    modules = dict(model.named_modules(remove_duplicate=False))
    unit_ids = {id(modules[p]): name for p, name in unit_of_path.items()}
    places: dict[int, dict[str, str]] = {}
    for path, module in modules.items():
        if not path or next(module.parameters(recurse=False), None) is None:
            continue
        parts = path.split(".")
        unit = next((unit_ids[id(modules[".".join(parts[:i])])] for i in range(len(parts), 0, -1)
                     if id(modules[".".join(parts[:i])]) in unit_ids), ROOT)
        places.setdefault(id(module), {}).setdefault(unit, path)
    for held in places.values():
        if len(held) > 1:
            paths = sorted(held.values())
            units = ", ".join(sorted(held))
            raise PlanError(f"module {paths[0]} is also {', '.join(paths[1:])}: one module in "
                            f"several FSDP2 units ({units}) would be sharded twice; raise "
                            "--min-params-to-wrap above those layers' size to keep them in "
                            "the root unit")


def count_params(modules: list[nn.Module], exclude: set[int] = frozenset()) -> int:
    seen: set[int] = set(exclude)
    total = 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def build_plan(model: nn.Module, *, world_size: int, min_params_to_wrap: int,
               checkpoint_activations: bool = False, no_reshard_after_forward: bool = False,
               reshard_degree: int = 0, root_reshard: str = "default",
               frozen_dtype: Optional[torch.dtype] = None) -> ShardingPlan:
    """Compute the plan for ``model``. See the module docstring for the policy."""
    threshold = 0 if checkpoint_activations else min_params_to_wrap
    layer_setting: ReshardSetting = (reshard_degree if reshard_degree > 0
                                     else not no_reshard_after_forward)
    shared_setting = True if root_reshard == "always" else False
    root_setting: ReshardSetting = True if root_reshard == "always" else None

    modules = dict(model.named_modules())
    candidates = layer_candidates(model)
    layers = [(p, m) for p, m in candidates if count_params([m]) >= threshold]

    groups = tied_groups(model)
    def unit_of(path: str) -> Optional[str]:
        return next((lp for lp, _ in layers if path == lp or path.startswith(lp + ".")), None)
    for g in groups:
        # a tie must stay inside one unit: one layer, or outside every layer (grouped below)
        if len({unit_of(p) for p in g}) > 1:
            raise PlanError(f"parameter tie between {', '.join(g)} crosses a layer unit; "
                            "these modules cannot be grouped into one FSDP2 unit")
    groups = [g for g in groups if unit_of(g[0]) is None]

    units: list[Unit] = []
    managed: set[int] = set()
    for path, m in layers:
        n = count_params([m], managed)
        managed.update(id(p) for p in m.parameters())
        units.append(Unit(path, LAYER, (path,), n, layer_setting))
    for i, g in enumerate(groups):
        ms = [modules[p] for p in g]
        n = count_params(ms, managed)
        managed.update(id(p) for m in ms for p in m.parameters())
        units.append(Unit("shared" if len(groups) == 1 else f"shared{i}", SHARED, tuple(g), n,
                          shared_setting))
    total = count_params([model])
    check_shared_modules(model, {p: u.name for u in units for p in u.module_paths})
    unit_ids = {id(modules[p]) for u in units for p in u.module_paths}
    entries = tuple(p for p in entry_modules(model) if id(modules[p]) not in unit_ids)
    units.append(Unit(ROOT, ROOT, ("",), count_params([model], managed), root_setting))

    plan = ShardingPlan(units, total, world_size, min_params_to_wrap, entries=entries,
                        lora=lora_plan(model, frozen_dtype))
    if world_size > 1 and candidates and not layers:
        largest = max(count_params([m]) for _, m in candidates)
        plan.warnings.append(
            f"--min-params-to-wrap {min_params_to_wrap:,} wraps no layer (the largest has "
            f"{largest:,} parameters): the layers stay in the root unit, whose parameters are "
            f"gathered whole on every rank, so peak memory per rank drops little. "
            f"Use --min-params-to-wrap {largest:,} or less to shard per layer.")
    return plan


def lora_plan(model: nn.Module, frozen_dtype: Optional[torch.dtype]) -> Optional[LoraPlan]:
    """The LoRA part of the plan of an adapted model (models/lora.py), None otherwise."""
    spec = lora.spec_of(model)
    if spec is None:
        return None
    adapters = trained = frozen = 0
    for name, param in model.named_parameters():
        if lora.is_adapter(name):
            adapters += param.numel()
        elif param.requires_grad:
            trained += param.numel()
        else:
            frozen += param.numel()
    return LoraPlan(spec.rank, len(spec.modules), adapters, trained, frozen, frozen_dtype)
