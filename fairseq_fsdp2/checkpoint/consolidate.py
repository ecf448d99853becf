"""Consolidated export: a sharded FSDP2 checkpoint -> one stock fairseq checkpoint file.

The output holds the full model weights (tied weights under every alias, as fairseq stores
them), cfg and training history, and no sharded or optimizer state, so stock
``fairseq-generate``/``fairseq-interactive`` read it without the plugin. Runs on one process
and no process group (DCP's ``no_dist`` load); it never needs more than one copy of the model.

    python -m fairseq_fsdp2.consolidate CHECKPOINT OUT.pt
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed.checkpoint as dcp

from ..errors import CheckpointError
from ..models.nllb import NLLB_SIZES
from . import sharded
from .safe_load import read_checkpoint_file

CONSOLIDATED_SUFFIX = "_consolidated.pt"


def consolidate(checkpoint: str, out: str) -> str:
    state = read_checkpoint_file(checkpoint)
    info = state.get("fsdp2")
    if not isinstance(info, dict):
        raise CheckpointError(f"{checkpoint} is not a sharded FSDP2 checkpoint")
    shard_dir = sharded.resolve(checkpoint, info["shards"])
    metadata = sharded.read_metadata(shard_dir, checkpoint)
    model = {key[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items() if key.startswith("model.")}
    dcp.load({"model": model}, checkpoint_id=shard_dir, no_dist=True)
    for alias, canonical in info["aliases"].items():
        model[alias] = model[canonical]
    result = {k: v for k, v in state.items() if k not in ("fsdp2", "last_optimizer_state")}
    result["model"] = model
    result["cfg"] = _stock_cfg(state.get("cfg"))
    tmp = out + ".tmp"
    torch.save(result, tmp)
    os.replace(tmp, out)
    return out


def _stock_cfg(cfg):
    """The cfg as stock fairseq reads it: without the plugin's backend and options, and with
    plain dicts for argparse Namespaces (legacy archs keep cfg.model as one), which
    ``torch.load(weights_only=True)`` - torch's default since 2.6 - refuses to unpickle."""
    cfg = _plain(cfg)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("distributed_training"), dict):
        return cfg
    dt = {k: v for k, v in cfg["distributed_training"].items() if not k.startswith("fsdp2_")}
    if dt.get("ddp_backend") == "fsdp2":
        dt["ddp_backend"] = "pytorch_ddp"
    cfg = {**cfg, "distributed_training": dt}
    model = cfg.get("model")
    if isinstance(model, dict) and {model.get("_name"), model.get("arch")} & set(NLLB_SIZES):
        # the plugin's NLLB architectures are registered only with the plugin; every value
        # they set is in the saved model config, so stock fairseq builds them as `transformer`
        cfg["model"] = {**model, "_name": "transformer", "arch": "transformer"}
    return cfg


def _plain(value):
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def consolidate_at_end(save_dir: str) -> list[str]:
    """After training (rank 0): export checkpoint_best/last and drop unreferenced shards."""
    written = []
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        path = os.path.join(save_dir, name)
        if os.path.isfile(path):
            written.append(consolidate(path, path[:-3] + CONSOLIDATED_SUFFIX))
    sharded.remove_unreferenced(save_dir)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fairseq_fsdp2.consolidate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint file saved by --ddp-backend fsdp2")
    parser.add_argument("out", help="the consolidated .pt file to write")
    args = parser.parse_args(argv)
    if os.path.abspath(args.out) == os.path.abspath(args.checkpoint):
        print("consolidate: error: OUT must differ from CHECKPOINT", file=sys.stderr)
        return 2
    try:
        consolidate(args.checkpoint, args.out)
    except CheckpointError as e:
        print(f"consolidate: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0
