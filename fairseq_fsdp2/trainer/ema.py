"""fairseq's EMA (``--store-ema``) of a model sharded with FSDP2: every rank keeps the EMA of its
own shards, so no rank holds a full copy.

fairseq's EMA (fairseq/models/ema/ema.py) deep-copies the whole model, and its Trainer saves the
copy in rank 0's checkpoint file. ``ShardedEMA`` keeps fairseq's schedule (its ``step``:
--ema-decay, --ema-start-update, --ema-update-freq) and its update rule, applied to one tensor
per shard after each optimizer step. ``TrainerEMA``, a mixin of the FSDP2 trainer, writes the EMA
into the checkpoint's shards beside the model (extra_state["ema"] references them, as the model
entry does), restores it at any world size, and saves fairseq's --ema-update-freq counter, which
fairseq does not, so that a resumed run steps the EMA at the uninterrupted run's updates.

fairseq 0.12 differs in two ways, both faults of its EMA that the shards do not share
(docs/compatibility.md): it decays a tied weight once per name per step (NLLB's shared
embedding, three names: decay^3), since its updates run on the state dict, where the names
share one tensor; and it drops the final layer norms of a pre-norm model from the EMA, since its
``restore`` loads the EMA without the version keys, and the model's upgrade then takes the
state for an old checkpoint's and removes ``encoder.layer_norm`` and ``decoder.layer_norm``.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.nn as nn
from fairseq.models.ema import EMA
from omegaconf import open_dict

from ..checkpoint import sharded
from ..checkpoint.export import EMA_FP32_KEY, EMA_KEY
from ..checkpoint.full_state import copy_full_state
from ..checkpoint.safe_load import read_checkpoint_file
from ..errors import CheckpointError, OptionError
from ..optimizer.mixed_precision import compute_dtype
from ..sharding.mesh import local_part

logger = logging.getLogger(__name__)

#: fairseq keeps its --ema-update-freq counter in memory only; the plugin saves it here.
COUNTER_KEY = "fsdp2_ema_update_freq_counter"


def _averaged(key: str, tensor: torch.Tensor) -> bool:
    """fairseq averages every floating-point entry of the state dict but the version keys."""
    return tensor.is_floating_point() and "version" not in key


class ShardedEMA(EMA):
    """fairseq's EMA over the shards of an FSDP2 model: ``params`` holds, by canonical name (a
    tied weight once), a DTensor of the EMA for each sharded parameter (each rank: its shards)
    and a plain copy for each buffer. ``step`` is fairseq's.

    Precision as in fairseq, whose model holds the weights in the compute dtype (fp16/bf16
    under --fp16/--bf16): the EMA averages the weights in that dtype, and is kept in it, or in
    fp32 with --ema-fp32 (without --fp16/--bf16: fp32)."""

    def __init__(self, model: nn.Module, config, compute: Optional[torch.dtype] = None):
        # Not fairseq's __init__, which deep-copies the whole model.
        self.config = config
        self.decay = config.ema_decay
        self.update_freq_counter = 0
        self.skip_keys: set = set()
        self.compute_dtype = compute
        self.dtype = torch.float32 if config.ema_fp32 or compute is None else compute
        other_names = sharded.aliases(model)
        with torch.no_grad():
            self.params = {key: self._weights(value).to(self.dtype, copy=True)
                           if _averaged(key, value) else value.detach().clone()
                           for key, value in model.state_dict().items()
                           if key not in other_names}
        if config.ema_seed_model:
            self.load_seed(config.ema_seed_model)

    def _weights(self, tensor: torch.Tensor) -> torch.Tensor:
        """The weights as fairseq's model holds them: in the compute dtype."""
        tensor = tensor.detach()
        return tensor if self.compute_dtype is None else tensor.to(self.compute_dtype)

    def get_model(self):
        raise OptionError("--store-ema with --ddp-backend fsdp2 keeps the EMA as shards, not as "
                          "a model: a task that uses the EMA model in its steps (task.uses_ema) "
                          "is not served")

    def build_fp32_params(self, state_dict=None):
        """fairseq's fp32 copy: the EMA itself is kept in fp32 with --ema-fp32."""
        if state_dict is not None:
            self.restore(state_dict)

    @torch.no_grad()
    def _step_internal(self, new_model, updates=None):
        """fairseq's update of each averaged tensor, ema = decay x ema + (1 - decay) x weights
        (its mul_ and add_, on this rank's shards), version keys untouched."""
        state = new_model.state_dict()
        for key, ema in self.params.items():
            if _averaged(key, ema):
                weights = self._weights(local_part(state[key]))
                local_part(ema).mul_(self.decay).add_(weights.to(self.dtype), alpha=1 - self.decay)

    def restore(self, state_dict, build_fp32_params=False) -> list[str]:
        """Copy a full EMA that every rank holds (a stock checkpoint's) into the shards. Not
        strict, as fairseq's: the names it lacks keep their values (returned)."""
        return copy_full_state({k: v for k, v in self.params.items() if _averaged(k, v)},
                               state_dict)

    @torch.no_grad()
    def reverse(self, model):
        """Load the EMA into the (sharded) model, as fairseq's ``reverse``."""
        state = model.state_dict()
        for key, ema in self.params.items():
            if _averaged(key, ema):
                local_part(state[key]).copy_(local_part(ema))
        return model

    def load_shards(self, checkpoint_file: str, saved: dict) -> None:
        """Every rank: its part of the EMA saved in a checkpoint's shards (any world size)."""
        sharded.load_entry(EMA_KEY, self.params,
                           sharded.resolve(checkpoint_file, saved[sharded.SHARDED]))

    def load_seed(self, path: str) -> None:
        """--ema-seed-model: the EMA of another checkpoint, as fairseq's
        checkpoint_utils.load_ema_from_checkpoint reads it (extra_state["ema"]), from a stock
        checkpoint, the consolidated export or an FSDP2 checkpoint's shards. Every rank reads
        the file memory-mapped (as --restore-file) and copies only its shards."""
        seed = read_checkpoint_file(path)
        saved = (seed.get("extra_state") or {}).get(EMA_KEY)
        if sharded.is_sharded(saved):
            self.load_shards(path, saved)
        elif isinstance(saved, dict) and saved:
            try:
                missing = self.restore(saved)
            except CheckpointError as e:
                raise CheckpointError(f"--ema-seed-model {path} does not fit this model: {e}")
            _report_missing(missing, f"the EMA of --ema-seed-model {path}")
        else:
            raise CheckpointError(f"--ema-seed-model {path} holds no EMA (extra_state['ema']): "
                                  f"was it trained with --store-ema?")
        logger.info(f"EMA seeded from {path}")


def _report_missing(missing: list[str], source: str) -> None:
    if missing:
        logger.warning(f"{source} lacks {len(missing)} of the model's tensors "
                       f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): "
                       f"their EMA starts from the model's weights")


@contextlib.contextmanager
def _fairseq_ema_hidden(cfg):
    """fairseq's Trainer saves (state_dict) and restores (load_checkpoint) its own EMA when
    cfg.ema.store_ema; TrainerEMA does both for the shards, with fairseq's flag off meanwhile."""
    with open_dict(cfg):
        cfg.ema.store_ema = False
    try:
        yield
    finally:
        with open_dict(cfg):
            cfg.ema.store_ema = True


class TrainerEMA:
    """Mixin for ``FSDP2Trainer`` (first among its bases, before ``TrainerCheckpoints``):
    --store-ema with a ``ShardedEMA``. fairseq's train_step steps it after each update."""

    def _build_ema(self):
        if self.cfg.ema.store_ema:
            self._ema = ShardedEMA(self.model, self.cfg.ema, compute_dtype(self.cfg.common))
            logger.info(f"EMA of the model's shards initialized ({self._ema.dtype}, every rank "
                        f"its own shards)")

    def sharded_extras(self) -> dict:
        extras = super().sharded_extras()
        if self.cfg.ema.store_ema:
            extras[EMA_KEY] = self.ema.params  # built here if no update has built it yet
        return extras

    def state_dict(self):
        if not self.cfg.ema.store_ema:
            return super().state_dict()
        with _fairseq_ema_hidden(self.cfg):
            state = super().state_dict()
        if isinstance(state.get("cfg"), dict):
            state["cfg"]["ema"]["store_ema"] = True  # the cfg was saved while hidden
        state["extra_state"][EMA_KEY] = {sharded.SHARDED: state["fsdp2"]["shards"]}
        state["extra_state"][COUNTER_KEY] = self.ema.update_freq_counter
        return state

    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False,
                        optimizer_overrides=None, reset_meters=False):
        args = (filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides, reset_meters)
        if not self.cfg.ema.store_ema:
            return super().load_checkpoint(*args)
        with _fairseq_ema_hidden(self.cfg):
            extra_state = super().load_checkpoint(*args)
        if extra_state is not None or self._weights_loaded:
            self._restore_ema(filename, extra_state or {})
        return extra_state

    def _restore_ema(self, filename: str, extra_state: dict) -> None:
        """After a load: the checkpoint's EMA if it has one (as fairseq), else the EMA starts
        from --ema-seed-model or the loaded weights (fairseq: the loaded weights; it then fails
        with KeyError: 'model')."""
        saved = extra_state.get(EMA_KEY)
        ema = self.ema  # built now, from the loaded weights or --ema-seed-model
        if sharded.is_sharded(saved):
            ema.load_shards(filename, saved)
            logger.info(f"Loading EMA from checkpoint {filename} (its shards)")
        elif isinstance(saved, dict) and saved:
            if ema.dtype == torch.float32 and isinstance(extra_state.get(EMA_FP32_KEY), dict):
                saved = extra_state[EMA_FP32_KEY]  # fairseq's --ema-fp32 copy: more precise
            _report_missing(ema.restore(saved), f"the EMA in {filename}")
            logger.info(f"Loading EMA from checkpoint {filename}")
        else:
            logger.warning(f"EMA not found in checkpoint {filename}, but --store-ema is set: "
                           f"the EMA starts from " + ("--ema-seed-model" if self.cfg.ema.
                                                      ema_seed_model else "the loaded weights"))
        ema.update_freq_counter = int(extra_state.get(COUNTER_KEY, 0))
