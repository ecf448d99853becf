"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), in fairseq's file layout.

fairseq names, copies and deletes checkpoint *files* (``checkpoint_last.pt``,
``checkpoint_1_200.pt``, ...). Each stays a small fairseq-format file (cfg, optimizer history,
lr scheduler, loss scale, iterator position, metrics) whose ``model`` and
``last_optimizer_state`` entries reference a DCP directory under ``<save-dir>/fsdp2_shards/``
written by every rank, so no rank ever gathers the full model. Copies share the directory;
directories no checkpoint file references any more are removed at the next save.

Atomic: shards are written to ``<dir>.tmp`` and renamed when complete, and fairseq then writes
the small file to ``.tmp`` and renames it, so a kill at any point leaves the previous checkpoint
of that name intact. DCP reshards on load, so a checkpoint saved at N ranks resumes at M.
With --write-checkpoints-asynchronously the same directories are written in the background
(async_save.py).

LoRA (``--lora-rank``, models/lora.py): a save's directory holds what trains (the adapters,
--lora-train-params, buffers) and its optimizer state; the frozen base is written once per save
dir, to ``fsdp2_shards/lora-base-<token>`` (in its stored dtype: 16 bits with --fp16/--bf16),
which every checkpoint file's header names (``lora_base``) beside its own shards.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import re
import secrets
import shutil
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict)

from ..errors import CheckpointError
from ..models import lora
from ..optimizer.moments.fit_saved_state import fit_to_saved
from .safe_load import read_checkpoint_file

#: Key marking a state entry that lives in a DCP directory (its value: the directory,
#: relative to the checkpoint file).
SHARDED = "fsdp2_sharded"
SHARDS_DIR = "fsdp2_shards"
#: fairseq's default --restore-file, which it resolves to <save-dir>/checkpoint_last<suffix>.pt
DEFAULT_RESTORE_FILE = "checkpoint_last.pt"
#: 2: a tied weight's shards are stored once, under its canonical name (1 stored them under
#: every alias: NLLB's embedding 3 times, +2.1 GB per NLLB-600M checkpoint). Both load.
FORMAT_VERSION = 2
#: True while the FSDP2 trainer loads a checkpoint (trainer/checkpoint_hooks.py): it reads the
#: shards itself, each rank its own part; any other reader gets the full weights (export.py).
_trainer_loading = contextvars.ContextVar("fsdp2_trainer_loading", default=False)


def restore_path(ckpt) -> str:
    """The file fairseq-train resumes from (``ckpt``: cfg.checkpoint), by fairseq's rule:
    <save-dir>/checkpoint_last<suffix>.pt for the default --restore-file, else --restore-file
    with --checkpoint-suffix put before its .pt."""
    if ckpt.restore_file == DEFAULT_RESTORE_FILE:
        return os.path.join(ckpt.save_dir, f"checkpoint_last{ckpt.checkpoint_suffix}.pt")
    return ckpt.restore_file.replace(".pt", f"{ckpt.checkpoint_suffix}.pt")


def is_sharded(state: dict) -> bool:
    return isinstance(state, dict) and SHARDED in state


@contextlib.contextmanager
def trainer_loading():
    token = _trainer_loading.set(True)
    try:
        yield
    finally:
        _trainer_loading.reset(token)


def is_trainer_loading() -> bool:
    return _trainer_loading.get()


def save(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], save_dir: str,
         num_updates: int, extra: Optional[dict] = None) -> str:
    """Every rank: write model (and optimizer) shards, and ``extra`` entries (name -> tensors by
    name, e.g. the EMA's shards: {"ema": {...}}); returns the directory relative to save_dir.
    Only complete directories ever carry their final name."""
    rel = new_shard_dir(num_updates)
    final = os.path.join(save_dir, rel)
    tmp = final + ".tmp"
    dcp.save(state_to_save(model, optimizer, extra), checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        os.rename(tmp, final)
    dist.barrier()
    return rel


def new_shard_dir(num_updates: int) -> str:
    """Every rank: a new shard directory's name, relative to the save dir (rank 0 draws it);
    written as ``<name>.tmp`` and renamed when complete."""
    token = [secrets.token_hex(4) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return os.path.join(SHARDS_DIR, f"u{num_updates:08d}-{token[0]}")


def state_to_save(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                  extra: Optional[dict] = None) -> dict:
    """What the shards hold: this rank's model state (each tied weight once), unless
    ``optimizer`` is None its optimizer state, and the ``extra`` entries (the EMA's); the
    tensors are the live ones, not copies."""
    state = {"model": _canonical_state(model, "trained")}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    state.update(extra or {})
    return state


def aliases(model: nn.Module) -> dict[str, str]:
    """Each other name of a tied weight -> its canonical (first) name."""
    canonical = {id(p): k for k, p in model.named_parameters()}
    return {k: canonical[id(p)] for k, p in model.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != k}


def _canonical_state(model: nn.Module, part: str = "all") -> dict:
    """The model's (sharded) state dict with each tied weight once: torch's state dict holds
    it under every alias, and DCP would write each. ``part``: "all"; of a LoRA model,
    "frozen" (its frozen parameters) or "trained" (the rest: adapters, trained parameters,
    buffers); of another model "trained" is all and "frozen" nothing."""
    other_names = aliases(model)
    frozen = frozen_names(model)
    keep = {"all": lambda k: True, "frozen": lambda k: k in frozen,
            "trained": lambda k: k not in frozen}[part]
    return {k: v for k, v in get_model_state_dict(model).items()
            if k not in other_names and keep(k)}


def frozen_names(model: nn.Module) -> set[str]:
    """The names of a LoRA model's frozen parameters (empty for another model)."""
    if lora.spec_of(model) is None:
        return set()
    return {k for k, p in model.named_parameters() if not p.requires_grad}


def save_base(model: nn.Module, save_dir: str) -> str:
    """Every rank: write a LoRA model's frozen parameters (their shards) to a new directory,
    once per save dir; returns it relative to save_dir."""
    rel = os.path.join(SHARDS_DIR, "lora-base-" + os.path.basename(new_shard_dir(0)))
    final = os.path.join(save_dir, rel)
    dcp.save({"model": _canonical_state(model, "frozen")}, checkpoint_id=final + ".tmp")
    dist.barrier()
    if dist.get_rank() == 0:
        os.rename(final + ".tmp", final)
    dist.barrier()
    return rel


def header(model: nn.Module, shards: str, world_size: int,
           lora_base: Optional[str] = None) -> dict:
    """What the small file records about the shards, including the tied-weight aliases that
    the shards do not hold (fairseq's format lists every alias), and of a LoRA model its
    adapters' settings and the directory of its frozen base."""
    info = {"version": FORMAT_VERSION, "shards": shards, "world_size": world_size,
            "aliases": aliases(model)}
    spec = lora.spec_of(model)
    if spec is not None:
        info["lora"] = {"rank": spec.rank, "scaling": spec.scaling, "dropout": spec.dropout,
                        "modules": list(spec.modules)}
        info["lora_base"] = lora_base
    return info


def resolve(checkpoint_file: str, rel: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(checkpoint_file)), rel)


def read_metadata(shard_dir: str, checkpoint_file: str):
    """The DCP metadata, after checking that every shard file it names is there and whole."""
    if not os.path.isfile(os.path.join(shard_dir, ".metadata")):
        raise CheckpointError(f"{checkpoint_file}: its shards are missing or incomplete "
                              f"({os.path.join(shard_dir, '.metadata')} not found)")
    try:
        metadata = dcp.FileSystemReader(shard_dir).read_metadata()
    except Exception as e:  # noqa: BLE001 - reported as one line naming the file
        raise CheckpointError(f"{shard_dir}/.metadata is unreadable: {e}") from e
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(shard_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"shard file missing: {path}")
        if os.path.getsize(path) < size:
            raise CheckpointError(f"shard file truncated: {path} ({os.path.getsize(path)} of "
                                  f"{size} bytes)")
    return metadata


def saved_shapes(metadata) -> dict:
    """Model tensor shapes recorded in DCP metadata, by name."""
    return {k[len("model."):]: getattr(v, "size", None)
            for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}


def model_shapes(model: nn.Module) -> dict[str, tuple]:
    """The shapes of the model's state by name, every alias of a tied weight included (of the
    full tensors: a DTensor's shape is the unsharded one)."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_model_matches(model: nn.Module, saved: dict, checkpoint_file: str) -> None:
    """Refuse a checkpoint of another model config, naming the first mismatches.
    ``saved``: name -> shape of what the checkpoint holds (tied aliases may be absent)."""
    ours = model_shapes(model)
    needed = _canonical_state(model).keys()  # each tied weight once
    problems = []
    for key in sorted(set(saved) | set(needed)):
        a, b = saved.get(key), ours.get(key)
        if a is None or b is None:
            problems.append(f"{key} {'not in checkpoint' if a is None else 'not in model'}")
        elif tuple(a) != b:
            problems.append(f"{key} checkpoint {tuple(a)} vs model {b}")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more"
                                           if len(problems) > 3 else "")
        raise CheckpointError(f"{checkpoint_file} does not fit this model: {shown}")


def load_model(model: nn.Module, shard_dir: str, base_dir: Optional[str] = None) -> None:
    """Load this rank's model shards in place (DCP reshards across world sizes); a tied weight
    is read once, under its canonical name (version 1 shards hold the aliases too: not read).
    ``base_dir``: a LoRA checkpoint's frozen base (save_base), the rest from ``shard_dir``."""
    if base_dir is None:
        dcp.load({"model": _canonical_state(model)}, checkpoint_id=shard_dir)
        return
    dcp.load({"model": _canonical_state(model, "frozen")}, checkpoint_id=base_dir)
    dcp.load({"model": _canonical_state(model, "trained")}, checkpoint_id=shard_dir)


def load_entry(name: str, tensors: dict, shard_dir: str) -> None:
    """Load an entry that ``save`` wrote from ``extra`` into ``tensors`` (sharded or plain, by
    name) in place; DCP reshards across world sizes."""
    dcp.load({name: tensors}, checkpoint_id=shard_dir)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, shard_dir: str) -> None:
    state = {"optim": get_optimizer_state_dict(model, optimizer)}
    # Adam's moments as saved (8-bit, 16-bit or float32, with or without scales): the run converts
    # them at its next step (optimizer/adam_stats.py)
    saved = dcp.FileSystemReader(shard_dir).read_metadata().state_dict_metadata
    fit_to_saved(state["optim"], {k: getattr(getattr(v, "properties", None), "dtype", None)
                                  for k, v in saved.items()})
    dcp.load(state, checkpoint_id=shard_dir)
    set_optimizer_state_dict(model, optimizer, state["optim"])


def referenced_dirs(save_dir: str) -> set[str]:
    """Shard directories (relative) that some checkpoint file in save_dir points to."""
    found = set()
    for name in os.listdir(save_dir):
        if name.endswith(".pt"):
            try:
                state = read_checkpoint_file(os.path.join(save_dir, name))
            except CheckpointError:  # an unreadable file references nothing
                continue
            if isinstance(state.get("fsdp2"), dict):
                found.add(state["fsdp2"]["shards"])
                if state["fsdp2"].get("lora_base"):
                    found.add(state["fsdp2"]["lora_base"])
    return found


def saved_updates(checkpoint_file: str) -> int:
    """The update count a fairseq checkpoint file was saved at."""
    return read_checkpoint_file(checkpoint_file)["optimizer_history"][-1]["num_updates"]


def update_checkpoints(save_dir: str, suffix: str = "") -> list[tuple[int, str]]:
    """fairseq's ``checkpoint_<epoch>_<updates><suffix>.pt`` files in save_dir (``suffix``:
    --checkpoint-suffix), newest first."""
    found = []
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        match = re.fullmatch(r"checkpoint_\d+_(\d+)" + re.escape(suffix) + r"\.pt", name)
        if match:
            found.append((int(match.group(1)), os.path.join(save_dir, name)))
    return sorted(found, reverse=True)


def is_complete(checkpoint_file: str) -> bool:
    """The file reads, and its shard directory is committed with every shard file whole."""
    try:
        state = read_checkpoint_file(checkpoint_file)
        read_metadata(resolve(checkpoint_file, state["fsdp2"]["shards"]), checkpoint_file)
        if state["fsdp2"].get("lora_base"):
            read_metadata(resolve(checkpoint_file, state["fsdp2"]["lora_base"]), checkpoint_file)
    except (CheckpointError, KeyError, TypeError):  # unreadable, not ours, shards missing
        return False
    return True


def newest_complete(save_dir: str, newer_than: int = -1,
                    suffix: str = "") -> Optional[tuple[int, str]]:
    """(updates, path) of the newest complete ``checkpoint_<epoch>_<updates><suffix>.pt`` saved
    after update ``newer_than``: what a restart resumes from when checkpoint_last<suffix>.pt is
    older or missing because a save died before fairseq copied the file to it."""
    for updates, path in update_checkpoints(save_dir, suffix):
        if updates <= newer_than:
            break
        if is_complete(path):
            return updates, path
    return None


def remove_unreferenced(save_dir: str) -> list[str]:
    """Delete shard directories no checkpoint file references (and leftovers of killed
    saves). Rank 0 only, between saves."""
    root = os.path.join(save_dir, SHARDS_DIR)
    if not os.path.isdir(root):
        return []
    keep = {os.path.normpath(r) for r in referenced_dirs(save_dir)}
    removed = []
    for name in sorted(os.listdir(root)):
        rel = os.path.normpath(os.path.join(SHARDS_DIR, name))
        if rel not in keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(rel)
    return removed
