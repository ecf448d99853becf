"""Safe loading of fairseq checkpoints under ``torch.load(weights_only=True)``.

torch >= 2.6 loads with ``weights_only=True`` by default and fairseq's checkpoints pickle a few
non-tensor classes. Instead of switching the safety off, allow exactly those classes.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import os
import re
import typing

import numpy as np
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

#: What numpy values need: fairseq keeps the best validation score (e.g. BLEU from sacrebleu) and
#: some meters as numpy scalars or arrays. A scalar pickles as ``scalar(dtype, bytes)``, an array
#: as ``_reconstruct(ndarray, ...)`` plus its dtype; each dtype is an instance of its own class
#: (``numpy.dtypes.Float64DType``), which must be allowed too. Only the numeric and bool dtypes:
#: never object, string or void arrays. Files written with numpy 1.x name the module
#: ``numpy.core.multiarray`` (numpy 2 renamed it ``numpy._core.multiarray``): both are allowed.
NUMERIC_DTYPE_CODES = "?bBhHiIlLqQefdgFDG"
_multiarray = np._core.multiarray  # noqa: SLF001 - where numpy's own pickles point
NUMPY_CHECKPOINT_GLOBALS = [
    np.ndarray, np.dtype, _multiarray.scalar, _multiarray._reconstruct,
    (_multiarray.scalar, "numpy.core.multiarray.scalar"),
    (_multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    *sorted({type(np.dtype(code)) for code in NUMERIC_DTYPE_CODES}, key=str),
]


#: Opt-in for files you trust that pickle other classes: their paths, separated by ':'.
TRUSTED_ENV = "FAIRSEQ_FSDP2_TRUSTED_CHECKPOINTS"


def allow_fairseq_checkpoint_classes() -> None:
    torch.serialization.add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS + NUMPY_CHECKPOINT_GLOBALS)


def python_numbers(value):
    """``value`` with every numpy scalar turned into its Python number and every numpy array
    of numbers into a tensor, in nested dicts, lists and tuples: what the plugin writes holds
    no numpy (fairseq's own meters add tensors and arrays alike)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        return torch.from_numpy(value)
    if isinstance(value, dict):
        out = value.copy()  # keeps the dict's class (OrderedDict, defaultdict)
        out.update((k, python_numbers(v)) for k, v in value.items())
        return out
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(python_numbers(v) for v in value)
    return value


def trusted(path: str) -> bool:
    listed = [p for p in os.environ.get(TRUSTED_ENV, "").split(os.pathsep) if p]
    return any(os.path.abspath(p) == os.path.abspath(path) for p in listed)


@contextlib.contextmanager
def trusting(path: str):
    """For a file the user listed as trusted (TRUSTED_ENV), around the loads of it:
    ``torch.load``'s allow-list widened by exactly the classes it pickles, for the block only
    (loading stays weights_only; later loads of other files accept none of them). Yields those
    class names ([] for a file not listed). Classes already allowed are left as they are."""
    if not trusted(path):
        yield []
        return
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    allowed = torch.serialization.get_safe_globals()
    objects = []
    for name in names:
        module, _, attr = name.rpartition(".")
        found = getattr(importlib.import_module(module), attr)
        if found not in allowed and found not in objects:
            objects.append(found)
    with torch.serialization.safe_globals(objects):
        yield names


def read_checkpoint_file(path: str, mmap: bool = True) -> dict:
    """A fairseq checkpoint file, loaded with ``weights_only=True``; one clear error if it is
    missing, unreadable, or pickles something outside the allow-list. With ``mmap`` the
    tensors stay in the file until read, so peeking at a large checkpoint costs no memory."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        with trusting(path):
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if not mmap or "mmap" not in str(e):
                    raise
                state = torch.load(path, map_location="cpu", weights_only=True)  # pre-zip
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, unsafe, or not a checkpoint
        text = str(e)
        unsafe = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(
            r"allowlisted via `add_safe_globals`, but got <class '([\w.]+)'>", text)
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
