"""Safe loading of fairseq checkpoints under ``torch.load(weights_only=True)``.

torch >= 2.6 loads with ``weights_only=True`` by default and fairseq's checkpoints pickle a few
non-tensor classes. Instead of switching the safety off, allow exactly those classes.
"""
from __future__ import annotations

import argparse
import collections
import typing

import torch
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


def allow_fairseq_checkpoint_classes() -> None:
    torch.serialization.add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS)
