"""The FSDP2 trainer: fairseq's Trainer with the model sharded by ``fully_shard``.

Only what FSDP2 changes is overridden; the train loop, update-freq, logging, validation and
checkpoint bookkeeping stay fairseq's own.
"""
from __future__ import annotations

import contextlib
import logging
import os
from itertools import chain

import torch
import torch.distributed as dist
from fairseq import utils
from fairseq.logging import metrics
from fairseq.optim import lr_scheduler
from fairseq.trainer import Trainer
from omegaconf import open_dict
from torch.distributed.tensor import DTensor

from . import precision
from .apply import apply_plan, build_mesh
from .checkpoint.full_state import full_model_state_dict, install_optimizer_hooks
from .memory import MemoryMonitor
from .plan import ShardingPlan, build_plan

logger = logging.getLogger(__name__)

DEFAULT_MIN_PARAMS_TO_WRAP = int(1e8)  # fairseq's default


class FSDP2Trainer(Trainer):
    """Trains a model sharded with FSDP2 (``--ddp-backend fsdp2``)."""

    def __init__(self, cfg, task, model, criterion, quantizer=None):
        # fairseq's Trainer.__init__ casts the model to fp16/bf16 and refuses --cpu-offload unless
        # the backend is fairscale's. Here the sharded fp32 parameters are the master weights
        # (precision.py) and --cpu-offload maps to FSDP2's offload, so hide those flags from it.
        with _flags_hidden(cfg, ("common", "fp16"), ("common", "bf16"),
                           ("common", "memory_efficient_fp16"),
                           ("distributed_training", "cpu_offload")):
            super().__init__(cfg, task, model, criterion, quantizer)
        self.sharding_plan: ShardingPlan | None = None
        self._overflowed = False
        self._memory = MemoryMonitor(
            self.device,
            os.path.join(cfg.checkpoint.save_dir, "memory.jsonl") if cfg.checkpoint.save_dir
            else None,
            rank=self.data_parallel_rank)

    # -- wrapping ------------------------------------------------------------------------------
    @property
    def use_distributed_wrapper(self) -> bool:
        return False  # no DDP-style wrapper: the model is sharded in place (see `model`)

    @property
    def model(self):
        if self._wrapped_model is None:
            self._wrapped_model = self._shard(self._model)
        return self._wrapped_model

    def _shard(self, model):
        dt = self.cfg.distributed_training
        world = dist.get_world_size() if dist.is_initialized() else 1
        plan = build_plan(
            model, world_size=world,
            min_params_to_wrap=getattr(self.cfg.model, "min_params_to_wrap",
                                       DEFAULT_MIN_PARAMS_TO_WRAP),
            checkpoint_activations=bool(getattr(self.cfg.model, "checkpoint_activations", False)),
            no_reshard_after_forward=dt.no_reshard_after_forward,
            reshard_degree=dt.fsdp2_reshard_degree, root_reshard=dt.fsdp2_root_reshard)
        if self.is_data_parallel_master:
            logger.info("\n" + plan.table())
            for warning in plan.warnings:
                logger.warning(warning)
        self.sharding_plan = plan
        mesh = build_mesh(self.device.type, world, dt.fsdp2_replicate_degree)
        dtype = precision.compute_dtype(self.cfg.common)
        precision.cast_float_buffers(model, dtype)
        apply_plan(model, plan, mesh, mp_policy=precision.mixed_precision_policy(self.cfg.common),
                   cpu_offload=dt.cpu_offload)
        if dt.fsdp2_no_sync_micro_batches:
            # fairseq's update-freq loop calls model.no_sync() on all but the last micro-batch
            # when the model has one; give the sharded model FSDP2's equivalent.
            model.no_sync = lambda: _no_gradient_sync(model)
        return model

    # -- optimizer -----------------------------------------------------------------------------
    def _build_optimizer(self):
        params = [p for p in chain(self.model.parameters(), self.criterion.parameters())
                  if p.requires_grad]
        self._optimizer = precision.build_optimizer(self.cfg, params)
        install_optimizer_hooks(self._optimizer.optimizer)
        self._lr_scheduler = lr_scheduler.build_lr_scheduler(self.cfg.lr_scheduler,
                                                             self.optimizer)
        self._lr_scheduler.step_update(0)

    def clip_grad_norm(self, clip_norm):
        # The gradients are DTensors: fairseq's norm over them is already the global norm.
        try:
            norm = self.optimizer.clip_grad_norm(clip_norm)
        except OverflowError:
            self._overflowed = True
            raise
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # -- the step ------------------------------------------------------------------------------
    def train_step(self, samples, raise_oom=False):
        self._overflowed = False
        try:
            logging_output = super().train_step(samples, raise_oom)
        except (AssertionError, RuntimeError):
            # fairseq's overflow branch ends with torch.tensor(0.0).cuda(), which raises without
            # CUDA; finish the skipped step the way fairseq does on GPUs.
            if not self._overflowed or self.cuda:
                raise
            logging_output = self._skip_overflowed_step()
        if logging_output is not None and \
                self.get_num_updates() % self.cfg.common.log_interval == 0:
            self._memory.log(self.get_num_updates())
        return logging_output

    def _skip_overflowed_step(self):
        self.zero_grad()
        with metrics.aggregate("train"):
            metrics.log_scalar("loss_scale", self.optimizer.scaler.loss_scale, priority=700,
                               round=4, weight=0)
            metrics.log_stop_time("train_wall")
        return None

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def always_call_state_dict_during_save_checkpoint(self) -> bool:
        return True  # gathering the full state is a collective: every rank takes part

    def state_dict(self):
        state = super().state_dict()
        state["model"] = full_model_state_dict(self.model)
        return state


@contextlib.contextmanager
def _no_gradient_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextlib.contextmanager
def _flags_hidden(cfg, *paths):
    saved = [(group, key, cfg[group][key]) for group, key in paths]
    with open_dict(cfg):
        for group, key, _ in saved:
            cfg[group][key] = False
    try:
        yield
    finally:
        with open_dict(cfg):
            for group, key, value in saved:
                cfg[group][key] = value


def select_trainer(cfg, task, model, criterion, quantizer=None):
    """What ``fairseq_cli.train`` calls as ``Trainer``: ours for the fsdp2 backend."""
    from .options import FSDP2_BACKEND
    if cfg.distributed_training.ddp_backend == FSDP2_BACKEND:
        return FSDP2Trainer(cfg, task, model, criterion, quantizer)
    return Trainer(cfg, task, model, criterion, quantizer)
