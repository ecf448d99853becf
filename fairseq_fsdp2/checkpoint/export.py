"""Consolidated export: a sharded FSDP2 checkpoint, or legacy FSDP's (fairscale)
``--use-sharded-state`` shard files, -> one stock fairseq checkpoint file.

The output holds the full model weights (tied weights under every alias, as fairseq stores
them), cfg and training history, the EMA of a --store-ema run where fairseq's Trainer keeps it
(extra_state), and no sharded or optimizer state, so stock
``fairseq-generate``/``fairseq-interactive`` read it without the plugin. Runs on one process
and no process group (DCP's ``no_dist`` load); it never needs more than one copy of the model
(and of its EMA).
``python -m fairseq_fsdp2.consolidate CHECKPOINT OUT.pt`` (consolidate.py) runs it by hand; the
end of a run runs it on rank 0 (``consolidate_at_end``).
"""
from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from ..errors import CheckpointError, no_space_left
from ..models import lora
from ..models.nllb import NLLB_SIZES
from ..options import PLUGIN_OPTIONS
from ..hf import lora_adapter, nllb_weights as hf_nllb
from ..hf.tokenizer_files import DATA_SUBDIR as TOKENIZER_SUBDIR
from . import legacy_fairscale, sharded
from .safe_load import read_checkpoint_file, trusting

CONSOLIDATED_SUFFIX = "_consolidated.pt"
#: Where fairseq's Trainer keeps its EMA (--store-ema) in a checkpoint's extra_state: the EMA
#: model's state dict, which checkpoint_utils.load_ema_from_checkpoint (--ema-seed-model) reads,
#: and with --ema-fp32 its fp32 copy. In an FSDP2 checkpoint, EMA_KEY references the shards.
EMA_KEY = "ema"
EMA_FP32_KEY = "ema_fp32_params"


def consolidate(checkpoint: str, out: str, data: str | None = None,
                out_format: str = "fairseq", ema: bool = False) -> str:
    """``checkpoint``: a file saved by --ddp-backend fsdp2, or one of legacy FSDP's
    ``<name>-shard<rank>.pt`` files (or ``<name>.pt`` for all of them); ``data`` replaces the
    data directory in a legacy save's cfg (the model is built from it to find tied weights).
    ``out_format`` "hf": ``out`` is a Hugging Face model directory, and ``checkpoint`` may
    also be a consolidated (stock) fairseq checkpoint; the tokenizer files come from the data
    directory (``data``, or the one in the checkpoint's cfg) when it has them. The EMA of a
    --store-ema run is written where fairseq keeps it (extra_state); ``ema``: the EMA's weights
    are the exported model instead (``checkpoint`` may then be a stock fairseq checkpoint
    too)."""
    if out_format == "peft":
        return peft_adapter(checkpoint, out)
    legacy = legacy_fairscale.shard_files(checkpoint)
    if legacy and ema:
        raise CheckpointError("--ema: legacy FSDP shards hold no EMA the plugin can read")
    if legacy:
        if any(os.path.abspath(out) == os.path.abspath(f) for f in legacy):
            raise CheckpointError("OUT must not be one of the shard files")
        states = legacy_fairscale.read_shards(legacy)
        state = states[0]
        model = legacy_fairscale.consolidate_shard_weights(
            [s["model"] for s in states], [s["fsdp_metadata"] for s in states])
        cfg = _stock_cfg(state.get("cfg"))
        model = legacy_fairscale.add_module_aliases(model, cfg, data)
    else:
        state = read_checkpoint_file(checkpoint)
        if ema:
            model = full_ema(checkpoint, state)
            if model is None:
                raise CheckpointError(f"{checkpoint} holds no EMA (extra_state['{EMA_KEY}']): "
                                      f"was it trained with --store-ema?")
            state = _with_ema(state, None)  # the EMA is the model now
        elif out_format == "hf" and "fsdp2" not in state:
            model = state["model"]  # already consolidated
        else:
            model = _fsdp2_model(checkpoint, state)
            if out_format != "hf":
                state = _with_ema(state, full_ema(checkpoint, state))
    if out_format == "hf":
        cfg = _stock_cfg(state.get("cfg"))
        model_cfg = cfg.get("model") if isinstance(cfg, dict) else None
        if not isinstance(model_cfg, dict):
            raise CheckpointError(f"{checkpoint} has no model config (cfg.model)")
        return hf_nllb.export(model, model_cfg, out, tokenizer_dir(cfg, data))
    return _write(state, model, out)


def tokenizer_dir(cfg, data: str | None) -> str | None:
    """DATA/hf_tokenizer of the data the checkpoint was trained on (``data``, else its cfg's
    task.data), if data preparation wrote one (--hf-model)."""
    task = cfg.get("task") if isinstance(cfg, dict) else None
    data = data or (task.get("data") if isinstance(task, dict) else None)
    if not isinstance(data, str) or not data:
        return None
    path = os.path.join(data.split(os.pathsep)[0], TOKENIZER_SUBDIR)
    return path if os.path.isdir(path) else None


def _write(state: dict, model: dict, out: str) -> str:
    """Write ``state`` with ``model`` as a stock checkpoint (atomically: .tmp, then rename)."""
    result = {k: v for k, v in state.items()
              if k not in ("fsdp2", "fsdp_metadata", "last_optimizer_state")}
    result["model"] = model
    result["cfg"] = _stock_cfg(state.get("cfg"))
    tmp = out + ".tmp"
    try:
        torch.save(result, tmp)
    except (OSError, RuntimeError) as e:  # torch.save's short write on a full disk: RuntimeError
        full = no_space_left(e, os.path.dirname(os.path.abspath(out)))
        if os.path.exists(tmp):
            os.remove(tmp)  # nothing half-written left behind
        if full:
            raise OSError(f"cannot write {out}: {full}") from e
        raise
    os.replace(tmp, out)
    return out


def read_with_full_weights(read, path, *args, **kwargs) -> dict:
    """Stand-in for fairseq's ``checkpoint_utils.load_checkpoint_to_cpu``
    (integration/registration.py), ``read`` being fairseq's: a sharded FSDP2 checkpoint read by anything but the FSDP2
    trainer (fairseq-generate, -validate, -interactive, --load-pretrained-encoder-from, the
    hub interface) gets the full weights, read from its shard directory in this process as
    the consolidated export reads them, where fairseq would find only the reference."""
    with trusting(path):  # a file listed in FAIRSEQ_FSDP2_TRUSTED_CHECKPOINTS: its classes
        state = read(path, *args, **kwargs)
    if sharded.is_sharded(state.get("model")) and not sharded.is_trainer_loading():
        state["model"] = _fsdp2_model(path, state)
        state = _with_ema(state, full_ema(path, state))  # where a stock checkpoint holds it
    return state


def read_full_model(checkpoint: str) -> dict:
    """The full model weights of a checkpoint file: a sharded FSDP2 one (read from its shard
    directory, in this process) or a stock one (memory-mapped)."""
    state = read_checkpoint_file(checkpoint)
    return _fsdp2_model(checkpoint, state) if "fsdp2" in state else state["model"]


def _fsdp2_model(checkpoint: str, state: dict) -> dict:
    """The full weights of an FSDP2 checkpoint; of a LoRA one the adapters merged into the
    base's weights (models/lora.py), so that stock fairseq reads them."""
    info = state.get("fsdp2") or {}
    if not info.get("lora_base"):
        return full_tensors(checkpoint, state, "model")
    return lora.merged(lora_tensors(checkpoint, state), info["lora"]["scaling"])


def peft_adapter(checkpoint: str, out: str) -> str:
    """A LoRA checkpoint's adapters as a PEFT adapter directory (hf/lora_adapter.py)."""
    state = read_checkpoint_file(checkpoint)
    info = state.get("fsdp2") if isinstance(state.get("fsdp2"), dict) else {}
    if not info.get("lora_base"):
        raise CheckpointError(f"{checkpoint} was not trained with --lora-rank: it has no "
                              f"adapters to export (--format peft)")
    tensors = lora_tensors(checkpoint, state)
    metadata = sharded.read_metadata(sharded.resolve(checkpoint, info["shards"]), checkpoint)
    trained = sorted(k[len("model."):] for k, md in metadata.state_dict_metadata.items()
                     if k.startswith("model.") and hasattr(md, "size") and
                     not lora.is_adapter(k) and torch.Size(md.size).numel() > 1)
    return lora_adapter.export(tensors, info["lora"], trained, out)


def lora_tensors(checkpoint: str, state: dict) -> dict:
    """A LoRA checkpoint's full tensors, unmerged: the frozen base (its own directory) and
    what trained (the adapters, --lora-train-params)."""
    info = state["fsdp2"]
    base = full_tensors(checkpoint, {"fsdp2": {**info, "shards": info["lora_base"],
                                               "aliases": {}}}, "model")
    trained = full_tensors(checkpoint, {"fsdp2": {**info, "aliases": {}}}, "model")
    tensors = {**base, **trained}
    for alias, canonical in info["aliases"].items():
        tensors[alias] = tensors[canonical]
    return tensors


def full_tensors(checkpoint: str, state: dict, entry: str) -> dict:
    """The full tensors of one entry of an FSDP2 checkpoint's shards ("model", "ema"), read in
    this process, every alias of a tied weight included (as fairseq stores them)."""
    info = state.get("fsdp2")
    if not isinstance(info, dict):
        raise CheckpointError(f"{checkpoint} is not a sharded FSDP2 checkpoint")
    shard_dir = sharded.resolve(checkpoint, info["shards"])
    metadata = sharded.read_metadata(shard_dir, checkpoint)
    # a tied weight is read once, under its canonical name: the shards may hold it under every
    # alias (NLLB: 3 x vocab x dim), and reading each would hold that many copies
    prefix = entry + "."
    tensors = {key[len(prefix):]: torch.empty(md.size, dtype=md.properties.dtype)
               for key, md in metadata.state_dict_metadata.items()
               if key.startswith(prefix) and key[len(prefix):] not in info["aliases"]}
    if not tensors:
        raise CheckpointError(f"{checkpoint}: its shards hold no {entry!r} entry")
    with warnings.catch_warnings():
        # torch warns that it assumes a single-process load even when told so (no_dist=True)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable "
                                "or uninitialized, assuming the intent is to load in a single "
                                "process", category=UserWarning,
                                module=r"torch\.distributed\.checkpoint\.")
        dcp.load({entry: tensors}, checkpoint_id=shard_dir, no_dist=True)
    for alias, canonical in info["aliases"].items():
        tensors[alias] = tensors[canonical]
    return tensors


def full_ema(checkpoint: str, state: dict) -> dict | None:
    """A checkpoint's EMA (--store-ema) as full tensors by name, or None if it has none: read
    from the shards of an FSDP2 checkpoint, as stored in a stock one."""
    ema = (state.get("extra_state") or {}).get(EMA_KEY)
    if sharded.is_sharded(ema):
        tensors = full_tensors(checkpoint, state, EMA_KEY)
        info = state.get("fsdp2") or {}
        # a LoRA run's EMA holds adapters (and the frozen base): merged as the model is
        return lora.merged(tensors, info["lora"]["scaling"]) if info.get("lora") else tensors
    return ema if isinstance(ema, dict) and ema else None


def _with_ema(state: dict, ema: dict | None) -> dict:
    """``state`` whose extra_state holds ``ema`` (full tensors) where fairseq's Trainer puts
    it, also as the --ema-fp32 copy when the run kept its EMA in fp32; None: no EMA."""
    extra = state.get("extra_state")
    if not isinstance(extra, dict) or (ema is None and EMA_KEY not in extra):
        return state
    extra = {k: v for k, v in extra.items() if k not in (EMA_KEY, EMA_FP32_KEY)}
    if ema is not None:
        extra[EMA_KEY] = ema
        cfg = plain_config(state.get("cfg"))
        if isinstance(cfg, dict) and (cfg.get("ema") or {}).get("ema_fp32"):
            extra[EMA_FP32_KEY] = ema  # the same fp32 tensors: torch.save writes them once
    return {**state, "extra_state": extra}


def _stock_cfg(cfg):
    """The cfg as stock fairseq reads it: without the plugin's backend and options (or legacy
    FSDP's sharded state), and with plain dicts for argparse Namespaces (legacy archs keep
    cfg.model as one), which ``torch.load(weights_only=True)`` - torch's default since 2.6 -
    refuses to unpickle."""
    cfg = plain_config(cfg)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("distributed_training"), dict):
        return cfg
    dt = {k: v for k, v in cfg["distributed_training"].items()
          if not k.startswith("fsdp2_") and k not in PLUGIN_OPTIONS}
    if dt.get("ddp_backend") in ("fsdp2", "fully_sharded"):
        dt["ddp_backend"] = "pytorch_ddp"
    if dt.get("use_sharded_state"):
        dt["use_sharded_state"] = False
    cfg = {**cfg, "distributed_training": dt}
    model = cfg.get("model")
    if isinstance(model, dict) and {model.get("_name"), model.get("arch")} & set(NLLB_SIZES):
        # the plugin's NLLB architectures are registered only with the plugin; every value
        # they set is in the saved model config, so stock fairseq builds them as `transformer`
        cfg["model"] = {**model, "_name": "transformer", "arch": "transformer"}
    return cfg


def plain_config(value):
    """A saved config as plain containers: argparse Namespaces (the legacy architectures' args)
    and OmegaConf nodes become dicts and lists, at every depth."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {k: plain_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_config(v) for v in value)
    return value


def consolidate_at_end(save_dir: str, suffix: str = "") -> list[str]:
    """After training (rank 0): export checkpoint_best/last (with --checkpoint-suffix
    ``suffix``: checkpoint_best<suffix>.pt, exported to checkpoint_best<suffix>_consolidated.pt)
    and drop unreferenced shards. At most one full copy of the model is held (two with
    --store-ema: the model and its EMA): when both files reference the same shards (the last
    save was also the best) the model is read once for both, otherwise the first is freed
    before the second is read."""
    by_shards: dict[str, list[tuple[str, dict]]] = {}
    for name in (f"checkpoint_best{suffix}.pt", f"checkpoint_last{suffix}.pt"):
        path = os.path.join(save_dir, name)
        if os.path.isfile(path):
            state = read_checkpoint_file(path)
            info = state.get("fsdp2")
            shards = sharded.resolve(path, info["shards"]) if isinstance(info, dict) else path
            by_shards.setdefault(shards, []).append((path, state))
    written = []
    for files in by_shards.values():
        model, ema = _fsdp2_model(*files[0]), full_ema(*files[0])  # with --store-ema: 2 copies
        for path, state in files:
            written.append(_write(_with_ema(state, ema), model,
                                  path[:-3] + CONSOLIDATED_SUFFIX))
        del model, ema  # their only references: freed before the next ones are read
    sharded.remove_unreferenced(save_dir)
    return written
