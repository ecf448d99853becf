"""Legacy FSDP's sharded checkpoints -> full weights, without fairscale.

fairseq's ``--ddp-backend fully_sharded --use-sharded-state`` (fairscale's
FullyShardedDataParallel) saves one file per rank, ``<name>-shard<rank>.pt``. Each is a fairseq
checkpoint whose ``model`` is fairscale's ``local_state_dict()`` (that rank's parameter shards,
plus the buffers) and whose ``fsdp_metadata`` is its ``local_metadata_dict()``::

    {"param_metadata": [                      # one entry per FSDP unit (nested ones too)
        {"fsdp_path": "encoder.layers.0",      # module path without wrapper names, "" = root
         "params": {"flat_param_0": {          # backing parameter: key fsdp_path + "." + name
             "names": [...], "shapes": [...], "numels": [...],   # relative to the unit
             "padding": 1}},                   # zeros at the end of THIS rank's shard
         "shared_param_info": [(src, dst)],   # tied parameters, relative to the unit
         "no_broadcast_optim_state": False}], # True: not sharded (experts), rank 0's is full
     "buffer_names": [...]}                   # includes non-persistent ones (not saved)

A backing parameter is its parameters flattened and concatenated (one parameter when
``flatten_parameters`` is off), cut into equal chunks over the ranks and zero-padded at the end
to the length of the first chunk. Without flattening, a tied parameter is saved under each of
its names as the same shard tensor (one storage in the file) but described only once.
fairscale skips wrapper modules (``_fsdp_wrapped_module``, ``_fpw_module``) in these names;
they are stripped here too in case a file still has them.
"""
from __future__ import annotations

import glob
import os
import re

import torch

from ..errors import CheckpointError, first_line
from .safe_load import read_checkpoint_file

SHARD_RE = re.compile(r"^(?P<prefix>.+)-shard(?P<rank>\d+)\.pt$")
WRAPPERS = {"_fsdp_wrapped_module", "_fpw_module"}


def shard_files(path: str) -> list[str] | None:
    """All shard files of the save ``path`` names (one of them, or the common prefix with or
    without ``.pt``), rank by rank; None if ``path`` is not a legacy shard set."""
    m = SHARD_RE.match(path)
    if m:
        prefix = m["prefix"]
    elif os.path.isfile(path):
        return None
    else:
        prefix = path[:-3] if path.endswith(".pt") else path
    found = {}
    for f in glob.glob(glob.escape(prefix) + "-shard*.pt"):
        fm = SHARD_RE.match(f)
        if fm and fm["prefix"] == prefix:
            found[int(fm["rank"])] = f
    if not found:
        return None
    first = read_checkpoint_file(found[min(found)])
    world = _world_size(first, found[min(found)])
    missing = [f"{prefix}-shard{r}.pt" for r in range(world) if r not in found]
    if missing:
        raise CheckpointError(f"shard file missing: {missing[0]} (the save has {world} shards: "
                              f"distributed_world_size in {found[min(found)]})")
    return [found[r] for r in range(world)]


def _world_size(state: dict, path: str) -> int:
    if "fsdp_metadata" not in state:
        raise CheckpointError(f"{path} is not a legacy FSDP shard (no fsdp_metadata)")
    try:
        return int(_get(state, "cfg", "distributed_training", "distributed_world_size"))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: no distributed_world_size in its cfg") from None


def _get(state, *keys):
    value = state
    for k in keys:
        value = value[k] if isinstance(value, dict) else getattr(value, k)
    return value


def _save_point(state: dict) -> tuple:
    """(updates, epoch, iterations in epoch) of the save: equal on every rank of one save."""
    history = state.get("optimizer_history") or [{}]
    itr = (state.get("extra_state") or {}).get("train_iterator") or {}
    return (history[-1].get("num_updates"), itr.get("epoch"), itr.get("iterations_in_epoch"))


def _layout(metadata: dict) -> list:
    """The metadata without the per-rank padding: the same on every rank of one save."""
    return [(u["fsdp_path"], [(b, list(p["names"]), [tuple(s) for s in p["shapes"]],
                               list(p["numels"])) for b, p in u["params"].items()],
             [tuple(s) for s in u.get("shared_param_info", [])])
            for u in metadata["param_metadata"]]


def read_shards(files: list[str]) -> list[dict]:
    """The shard files' states, checked to be one save."""
    states = [read_checkpoint_file(f) for f in files]
    world = len(files)
    first = files[0]
    for rank, (f, state) in enumerate(zip(files, states)):
        if _world_size(state, f) != world:
            raise CheckpointError(f"shards are not from the same save: {f} has distributed_"
                                  f"world_size {_world_size(state, f)}, {first} {world}")
        saved_rank = _get(state, "cfg", "distributed_training").get("distributed_rank", rank) \
            if isinstance(state.get("cfg"), dict) else rank
        if saved_rank != rank:
            raise CheckpointError(f"{f} was saved by rank {saved_rank}, not {rank}")
        if _save_point(state) != _save_point(states[0]):
            (u, e, i), (u0, e0, i0) = _save_point(state), _save_point(states[0])
            raise CheckpointError(f"shards are not from the same save: {f} is at update {u} "
                                  f"(epoch {e}, iteration {i}), {first} at update {u0} "
                                  f"(epoch {e0}, iteration {i0})")
        if _layout(state["fsdp_metadata"]) != _layout(states[0]["fsdp_metadata"]):
            raise CheckpointError(f"shards are not from the same save: the fsdp_metadata of {f} "
                                  f"does not match {first}'s (another model or wrapping)")
    return states


def _clean(key: str) -> str:
    return ".".join(p for p in key.split(".") if p not in WRAPPERS)


def consolidate_shard_weights(shards: list[dict], metadata: list[dict]) -> dict:
    """Full weights from every rank's local state dict and metadata (rank order), with tied
    parameters under each of their names (the same tensor) and the saved buffers."""
    shards = [{_clean(k): v for k, v in sd.items()} for sd in shards]
    out, used = {}, set()
    for u, unit in enumerate(metadata[0]["param_metadata"]):
        prefix = unit["fsdp_path"] + "." if unit["fsdp_path"] else ""
        for backing, info in unit["params"].items():
            key = prefix + backing
            owners = shards[:1] if unit.get("no_broadcast_optim_state") else shards
            pieces = []
            for rank, sd in enumerate(owners):
                if key not in sd:
                    raise CheckpointError(f"shard {rank} has no {key}, which the fsdp_metadata "
                                          "lists")
                pad = metadata[rank]["param_metadata"][u]["params"][backing]["padding"]
                flat = sd[key].reshape(-1)
                pieces.append(flat[:flat.numel() - pad])
            full = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            if full.numel() != sum(info["numels"]):
                raise CheckpointError(f"the shards of {key} hold {full.numel()} values, its "
                                      f"fsdp_metadata {sum(info['numels'])}")
            for name, shape, part in zip(info["names"], info["shapes"],
                                         full.split(list(info["numels"]))):
                out[prefix + name] = part.view(tuple(shape))
            used.add(key)
        for src, dst in unit.get("shared_param_info", []):
            out.update([_tie(out, prefix + src, prefix + dst)])
    for name in metadata[0]["buffer_names"]:
        if name in shards[0]:  # non-persistent buffers are listed but not saved
            out[name] = shards[0][name]
            used.add(name)
    # keys the metadata does not describe: without flattening, the other names of a tied
    # parameter (the same shard tensor as the described one); else state that every rank saved
    # alike (replicated, like a buffer)
    by_storage = {(sd_t.untyped_storage().data_ptr(), sd_t.storage_offset(), tuple(sd_t.shape)): k
                  for k, sd_t in shards[0].items() if k in used and torch.is_tensor(sd_t)}
    backing_names = _single_names(metadata[0])
    for key, value in shards[0].items():
        if key in used or key in out:
            continue
        source = by_storage.get((value.untyped_storage().data_ptr(), value.storage_offset(),
                                 tuple(value.shape))) if torch.is_tensor(value) else None
        if source is not None and source in backing_names:
            out[key] = out[backing_names[source]]
        elif all(key in sd and _same(sd[key], value) for sd in shards[1:]):
            out[key] = value
        else:
            raise CheckpointError(f"cannot consolidate {key}: the fsdp_metadata does not "
                                  "describe it and the shards differ")
    return out


def _tie(out: dict, src: str, dst: str) -> tuple:
    """(alias, tensor) for a recorded tie. fairscale 0.4 records the two parameter names of a
    tie swapped (src: the source's module with the alias's name; dst: the alias's module with
    the source's name); that only shows when the names differ, as a src that is no parameter."""
    if src in out and dst not in out:
        return dst, out[src]
    (src_mod, _, src_name), (dst_mod, _, dst_name) = src.rpartition("."), dst.rpartition(".")
    true_src = f"{src_mod}.{dst_name}".lstrip(".")
    true_dst = f"{dst_mod}.{src_name}".lstrip(".")
    if true_src in out and true_dst not in out:
        return true_dst, out[true_src]
    raise CheckpointError(f"tied parameter {dst}: its source {src} is not in the shards")


def _single_names(metadata: dict) -> dict:
    """backing key -> full name, for backing parameters that hold one parameter."""
    names = {}
    for unit in metadata["param_metadata"]:
        prefix = unit["fsdp_path"] + "." if unit["fsdp_path"] else ""
        for backing, info in unit["params"].items():
            if len(info["names"]) == 1:
                names[prefix + backing] = prefix + info["names"][0]
    return names


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def add_module_aliases(weights: dict, cfg: dict, data: str | None = None) -> dict:
    """Add the names fairscale's metadata cannot hold: a module reachable under two paths (e.g.
    ``decoder.embed_tokens`` = ``encoder.embed_tokens`` with --share-all-embeddings) is
    flattened once, under its first path, but fairseq's state dict (and a strict load) has it
    under both. Builds the model from ``cfg`` on the meta device to find them, and checks that
    every weight the model has is there with its shape."""
    from fairseq import tasks, utils
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(cfg)
    if data:
        cfg.task.data = data
    try:
        if cfg.common.get("user_dir"):
            utils.import_user_module(cfg.common)
        task = tasks.setup_task(cfg.task)
        with torch.device("meta"):
            model = task.build_model(cfg.model)
    except Exception as e:  # noqa: BLE001 - any reason the model cannot be built here
        reason = first_line(e)
        raise CheckpointError(
            "cannot build the model from the checkpoint's cfg to find its tied weights "
            f"({reason}); if the data directory moved, pass --data DIR") from e
    state = model.state_dict()
    canonical = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), []).append(name)
    for names in canonical.values():
        have = [n for n in names if n in weights]
        for n in names:
            if have and n not in weights:
                weights[n] = weights[have[0]]
    missing = [k for k in state if k not in weights]
    if missing:
        raise CheckpointError(f"the shards hold no {missing[0]} ({len(missing)} weights of the "
                              "model missing)")
    for k, v in state.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{k}: the shards give shape {tuple(weights[k].shape)}, the "
                                  f"model has {tuple(v.shape)}")
    return weights
