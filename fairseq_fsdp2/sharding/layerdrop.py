"""LayerDrop that every rank draws alike (fairseq's ``--encoder-layerdrop``,
``--decoder-layerdrop``) under FSDP2.

Why: fairseq's ``LayerDropModuleList`` draws the layers to skip from torch's global random state
at each forward. fairseq seeds that state alike on every rank at each update (seed + updates),
but by the time the layers are drawn each rank's dropout has used it for its own batch, so the
ranks skip different layers. Under FSDP2 a layer unit is gathered and its gradient
reduce-scattered by every rank together: a layer one rank runs and another skips leaves those
collectives unpaired (gloo aborts on a size mismatch), and inside a larger unit the ranks
reduce different sets of gradients.

What: the layers skipped in an update are a function of ``--seed``, the update number and the
list's name (``encoder.layers``), drawn from a generator of their own (the global random state,
and with it dropout, is left alone). Every rank and every micro-batch of the update skip the
same layers, and a resumed run skips what the uninterrupted run skipped. A skipped layer unit is
gathered on no rank in that update and gets a gradient on no rank, so no rank waits in a
collective the others skip. Evaluation runs every layer, as in fairseq. The number of layers
skipped is logged with each update's figures (``encoder_layers_dropped``); which ones,
``dropped_layers`` tells (``LOGLEVEL=DEBUG`` also logs them).

The lists' class is changed on the instance before sharding (as ``fully_shard`` itself does);
parameter names, state dicts and checkpoints are unchanged.
"""
from __future__ import annotations

import hashlib
import logging

import torch
import torch.nn as nn
from fairseq.logging import metrics
from fairseq.modules import LayerDropModuleList

logger = logging.getLogger(__name__)


def dropped_layers(seed: int, num_updates: int, name: str, num_layers: int,
                   p: float) -> list[int]:
    """The indices of the layers of list ``name`` skipped in the update that follows
    ``num_updates`` completed updates (what fairseq passes to the model before each forward).
    A layer is kept when its uniform draw exceeds ``p``, as in fairseq's LayerDropModuleList."""
    digest = hashlib.sha256(f"{seed}:{num_updates}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    draws = torch.rand(num_layers, generator=generator)
    return [i for i in range(num_layers) if not draws[i] > p]


class SharedLayerDrop(LayerDropModuleList):
    """fairseq's LayerDropModuleList drawing from (seed, update, name): see the module's
    docstring. ``install`` sets ``seed`` and ``name``; fairseq's ``set_num_updates`` (called on
    every module before each training forward, and when a checkpoint is loaded) the update."""

    seed: int = 0
    name: str = "layers"
    num_updates: int = 0

    def set_num_updates(self, num_updates: int) -> None:
        self.num_updates = num_updates

    def __iter__(self):
        layers = nn.ModuleList.__iter__(self)
        if not self.training:
            yield from layers
            return
        dropped = dropped_layers(self.seed, self.num_updates, self.name, len(self), self.p)
        metrics.log_scalar(f"{self.name.split('.')[0]}_layers_dropped", len(dropped),
                           weight=1, round=2)
        logger.debug(f"update {self.num_updates + 1}: {self.name} skips layers {dropped}")
        for i, layer in enumerate(layers):
            if i not in dropped:
                yield layer


def install(model: nn.Module, seed: int) -> list[str]:
    """Make every LayerDropModuleList of ``model`` a SharedLayerDrop; the names of the lists."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, LayerDropModuleList):
            module.__class__ = SharedLayerDrop
            module.seed, module.name = seed, name
            names.append(name)
    return names
