"""Safe loading of fairseq checkpoints under ``torch.load(weights_only=True)``.

torch >= 2.6 loads with ``weights_only=True`` by default and fairseq's checkpoints pickle a few
non-tensor classes. Instead of switching the safety off, allow exactly those classes.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import typing

import torch

from ..errors import CheckpointError, first_line
from fairseq.distributed.utils import _TensorPlaceholder
from omegaconf import DictConfig, ListConfig, nodes
from omegaconf.base import ContainerMetadata, Metadata

#: What fairseq pickles: the legacy ``args``/``cfg.model`` Namespace, and the OmegaConf config
#: that ``distributed_utils.broadcast_object`` sends through torch.save/torch.load on resume
#: (with its ``_TensorPlaceholder``, a plain index holder).
FAIRSEQ_CHECKPOINT_GLOBALS = [
    argparse.Namespace, DictConfig, ListConfig, ContainerMetadata, Metadata, typing.Any,
    collections.defaultdict, list, dict, int, _TensorPlaceholder,
    nodes.AnyNode, nodes.StringNode, nodes.IntegerNode, nodes.FloatNode, nodes.BooleanNode,
]


#: Opt-in for files you trust that pickle other classes: their paths, separated by ':'.
TRUSTED_ENV = "FAIRSEQ_FSDP2_TRUSTED_CHECKPOINTS"


def allow_fairseq_checkpoint_classes() -> None:
    torch.serialization.add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS)


def trusted(path: str) -> bool:
    listed = [p for p in os.environ.get(TRUSTED_ENV, "").split(os.pathsep) if p]
    return any(os.path.abspath(p) == os.path.abspath(path) for p in listed)


def allow_classes_of(path: str) -> list[str]:
    """For a file the user listed as trusted: allow exactly the classes it pickles (loading
    stays weights_only, so fairseq's own torch.load calls read it too)."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    objects = []
    for name in names:
        module, _, attr = name.rpartition(".")
        objects.append(getattr(importlib.import_module(module), attr))
    torch.serialization.add_safe_globals(objects)
    return names


def read_checkpoint_file(path: str, mmap: bool = True) -> dict:
    """A fairseq checkpoint file, loaded with ``weights_only=True``; one clear error if it is
    missing, unreadable, or pickles something outside the allow-list. With ``mmap`` the
    tensors stay in the file until read, so peeking at a large checkpoint costs no memory."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if trusted(path):
        allow_classes_of(path)
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as e:
            if not mmap or "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # pre-zip format
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, unsafe, or not a checkpoint
        text = str(e)
        unsafe = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        if unsafe:
            raise CheckpointError(
                f"cannot read checkpoint {path}: it pickles {unsafe.group(1)}, which is not "
                "among the classes fairseq checkpoints hold; refused for safety (if you trust "
                f"the file, list it in {TRUSTED_ENV})") from e
        reason = first_line(e, None)
        unpickler = re.search(r"WeightsUnpickler error:\s*(.*)", text)
        if unpickler:  # torch's long "Weights only load failed" preamble: keep the cause
            reason = f"not a PyTorch checkpoint ({unpickler.group(1).strip()})"
        raise CheckpointError(f"cannot read checkpoint {path}: {reason[:200]}") from e
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a fairseq checkpoint (no 'model' entry)")
    return state
