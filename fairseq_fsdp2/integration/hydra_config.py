"""The hydra entry's config handling (``python -m fairseq_fsdp2.hydra_train``, hydra_train.py).

Legacy (argparse-only) tasks and architectures in a hydra config.
``translation_multi_simple_epoch``, the task NLLB trains with, has no dataclass, so stock hydra
cannot set it up (``AssertionError: Could not infer task type``). Here such a ``task`` node, and
a ``model`` node naming an architecture (``transformer_nllb_600m``), both with flat keys named
like the command-line flags (``encoder_langtok: src``, ``encoder_layers: 12``), become the
``argparse.Namespace`` that ``fairseq-train`` builds from the same flags: the task's defaults,
the values of the other groups, the architecture's defaults. Both paths then train the same
model and save the same checkpoint config, and a key the task or architecture does not know is
an error with one line (stock fairseq ignores a misspelt model key). Overrides of groups and keys
that do not exist are refused in one line too (``check_fixed_group_overrides``).
"""
from __future__ import annotations

import argparse
import dataclasses
from enum import Enum
from typing import Optional

from fairseq.dataclass.configs import FairseqConfig
from fairseq.dataclass.initialize import add_defaults as fairseq_add_defaults
from fairseq.dataclass.utils import omegaconf_no_object_check
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from ..errors import OptionError
from ..command_line.exits import owns_process, stop

LEGACY_GROUPS = ("task", "model")


class HydraConfigError(Exception):
    pass


def _node_name(node) -> Optional[str]:
    if isinstance(node, str):
        return node
    if isinstance(node, (DictConfig, dict)):
        return node.get("_name")
    return None


def _legacy_class(group: str, name: Optional[str]):
    """The argparse-configured class behind a task/model node, or None if fairseq's dataclass
    handling applies (or the name is unknown: fairseq reports that itself)."""
    if name is None:
        return None
    if group == "task":
        from fairseq.tasks import TASK_DATACLASS_REGISTRY, TASK_REGISTRY
        return TASK_REGISTRY[name] if name in TASK_REGISTRY and \
            name not in TASK_DATACLASS_REGISTRY else None
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY
    # an architecture name that is not itself a dataclass model (transformer_nllb_600m,
    # transformer_wmt_en_de, ...), or a model without a dataclass
    return ARCH_MODEL_REGISTRY[name] if name in ARCH_MODEL_REGISTRY and \
        name not in MODEL_DATACLASS_REGISTRY else None


def _given(node) -> dict:
    if isinstance(node, str):
        return {}
    values = OmegaConf.to_container(node, resolve=True)
    values.pop("_name", None)
    return values


def _parser(cls, group: str) -> argparse.ArgumentParser:
    """The class's options as fairseq-train adds them: task options with their defaults, model
    options without (parse_args_and_arch: only given values, the architecture fills in)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False, argument_default=(
        argparse.SUPPRESS if group == "model" else None))
    cls.add_args(parser)
    return parser


def _apply(ns: argparse.Namespace, parser: argparse.ArgumentParser, given: dict, group: str,
           name: str) -> None:
    """Set the node's values on ns as argparse would from the same flags (types, choices,
    custom actions such as FileContentsAction), then the defaults of the options not given;
    unknown keys are an error."""
    actions = {a.dest: a for a in parser._actions if a.dest is not argparse.SUPPRESS}
    for key, value in given.items():
        action = actions.get(key)
        if action is None:
            known = ", ".join(sorted(actions)[:8])
            raise HydraConfigError(f"{group}.{key} is not an option of {group} {name!r} "
                                   f"(keys are the command-line flags with '_': {known}, ...)")
        if isinstance(value, str) and action.nargs is None:
            try:
                action(parser, ns, parser._get_values(action, [value]), None)
            except argparse.ArgumentError as e:
                raise HydraConfigError(f"{group}.{key}: {e.message}") from None
        else:
            setattr(ns, key, value)
    for dest, action in actions.items():  # argparse's own handling of defaults
        if action.default is argparse.SUPPRESS or hasattr(ns, dest):
            continue
        default = action.default
        if isinstance(default, str):
            default = parser._get_value(action, default)
        setattr(ns, dest, default)


def _flatten_others(cfg: DictConfig) -> dict:
    """The flat values of every other group, as in the Namespace fairseq-train builds."""
    from fairseq.registry import REGISTRIES
    flat = {}
    for group in FairseqConfig.__dataclass_fields__:
        node = cfg.get(group)
        if group in LEGACY_GROUPS or not isinstance(node, DictConfig):
            continue
        if group in REGISTRIES and node.get("_name") is not None:
            flat.setdefault(group, node._name)  # criterion=..., optimizer=...
        for key in node:
            if key == "_name":
                continue
            try:
                value = node[key]
            except Exception:  # noqa: BLE001 - an interpolation into a legacy node
                continue
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
            elif isinstance(value, Enum):  # ChoiceEnum fields: plain strings, as on the CLI
                value = value.name
            flat.setdefault(key, value)
    return flat


def add_defaults(cfg: DictConfig) -> None:
    """fairseq's add_defaults, plus legacy task/architecture nodes -> Namespaces."""
    legacy = {}
    with open_dict(cfg):
        for group in LEGACY_GROUPS:
            node = cfg.get(group)
            cls = _legacy_class(group, _node_name(node))
            if cls is not None:
                legacy[group] = (cls, _node_name(node), _given(node))
                cfg[group] = None  # fairseq's add_defaults would merge the wrong dataclass
    fairseq_add_defaults(cfg)
    if not legacy:
        return

    base = _flatten_others(cfg)
    task_values = {}
    if "task" in legacy:
        cls, name, given = legacy["task"]
        ns = argparse.Namespace(**base, task=name)
        _apply(ns, _parser(cls, "task"), given, "task", name)
        ns._name = name
        task_values = vars(ns)
    elif isinstance(cfg.get("task"), DictConfig):
        task_values = _given(cfg.task)
    if "model" in legacy:
        from fairseq.models import ARCH_CONFIG_REGISTRY
        cls, name, given = legacy["model"]
        ns = argparse.Namespace(**{**base, **task_values, "arch": name})
        _apply(ns, _parser(cls, "model"), given, "model", name)
        if name in ARCH_CONFIG_REGISTRY:
            ARCH_CONFIG_REGISTRY[name](ns)  # what parse_args_and_arch does for --arch
        ns._name = name
        legacy["model"] = ns
    if "task" in legacy:
        legacy["task"] = argparse.Namespace(**task_values)
    # fairseq keeps legacy task/model configs as Namespaces inside the DictConfig
    # (convert_namespace_to_omegaconf); hydra_train's later to_container/create keeps them.
    with omegaconf_no_object_check(), open_dict(cfg):
        for group, ns in legacy.items():
            cfg[group] = ns


def add_defaults_or_stop(cfg: DictConfig) -> None:
    """``add_defaults``, with a bad config reported as bad input (command_line/exits.py decides: one
    line and exit status 2 for a single run, which the plugin's hydra entry owns; an
    OptionError for one job of a ``--multirun`` sweep, which hydra reports as the job's failure
    while the sweep goes on)."""
    try:
        add_defaults(cfg)
    except HydraConfigError as e:
        stop(OptionError(str(e)), owns_process())


def check_fixed_group_overrides(overrides: list[str]) -> None:
    """A ``group.key=value`` override of a group that does not exist, or of a group with a
    fixed schema (common, checkpoint, distributed_training, ...) whose key does not exist.
    Hydra refuses both too, but with a seven-line message and exit status 1; say it in one
    line, before hydra starts."""
    schema = {f.name: f.type for f in dataclasses.fields(FairseqConfig)}
    for override in overrides:
        key = override.split("=", 1)[0]
        if override.startswith(("+", "~", "-")) or "=" not in override or "." not in key:
            continue
        group, name = key.split(".", 1)
        if group not in schema and group != "hydra":
            raise HydraConfigError(f"{key}: {group} is not a config group (the groups: "
                                   f"{', '.join(sorted(schema))})")
        node = schema.get(group)
        if dataclasses.is_dataclass(node) and name.split(".")[0] not in {
                f.name for f in dataclasses.fields(node)}:
            raise HydraConfigError(f"{key} is not an option of {group} (the keys are the "
                                   f"command-line flags with '_'; misspelt?)")
