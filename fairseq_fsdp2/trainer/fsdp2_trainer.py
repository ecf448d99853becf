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
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import metrics
from fairseq.optim import lr_scheduler
from fairseq.trainer import Trainer
from omegaconf import open_dict

from .. import settings
from ..checkpoint.full_state import copy_into_shard, install_optimizer_hooks
from ..errors import CheckpointError, OutOfMemory, first_line
from ..process import heartbeat, run_context
from ..memory.breakdown import record_update
from ..memory.monitor import MemoryMonitor, describe_last
from ..optimizer import mixed_precision
from ..optimizer.moments.blockwise_8bit import release_workspaces
from ..optimizer.build import build_optimizer, keeps_bf16_weights, steps_in_backward
from ..optimizer.step_in_backward import StepInBackward
from ..models import lora
from ..options import (FSDP2_BACKEND, lora_modules, lora_scaling, lora_train_patterns,
                       tied_grad_buffer_on)
from ..sharding import layerdrop, meta_build, sixteen_bit_grads, tied_grad_buffer, tied_grad_reduce
from ..sharding.units import all_unsharded, apply_plan
from ..sharding.mesh import build_mesh
from ..sharding.plan import ShardingPlan, build_plan
from . import resume
from .checkpoint_hooks import TrainerCheckpoints
from .ema import TrainerEMA

logger = logging.getLogger(__name__)

DEFAULT_MIN_PARAMS_TO_WRAP = int(1e8)  # fairseq's default


class FSDP2Trainer(TrainerEMA, TrainerCheckpoints, Trainer):
    """Trains a model sharded with FSDP2 (``--ddp-backend fsdp2``); its checkpoints:
    checkpoint_hooks.py; its EMA (--store-ema): ema.py."""

    def __init__(self, cfg, task, model, criterion, quantizer=None):
        # fairseq's Trainer.__init__ casts the model to fp16/bf16 and refuses --cpu-offload unless
        # the backend is fairscale's. Here the sharded fp32 parameters are the master weights
        # (optimizer/) and --cpu-offload maps to FSDP2's offload, so hide those flags from it.
        # It also moves the whole model to the device (on GPUs a full copy per rank, and
        # impossible for a meta-device model); fully_shard moves each rank's shards instead.
        self._in_base_init = True
        with _flags_hidden(cfg, ("common", "fp16"), ("common", "bf16"),
                           ("common", "memory_efficient_fp16"),
                           ("distributed_training", "cpu_offload")):
            super().__init__(cfg, task, model, criterion, quantizer)
        self._in_base_init = False
        self._criterion = self._criterion.to(device=self.device)
        self._weights_loaded = False  # a meta-built model must be loaded before use
        self.sharding_plan: ShardingPlan | None = None
        self._overflowed = False
        self._in_backward = None  # --fsdp2-step-in-backward's step, with the optimizer
        self._loading_from: str | None = None  # the checkpoint file being loaded
        self._shards: str | None = None  # written by consolidate_optimizer, for state_dict
        self._memory = MemoryMonitor(
            self.device,
            None if cfg.checkpoint.no_save else os.path.join(cfg.checkpoint.save_dir,
                                                             "memory.jsonl"),
            rank=self.data_parallel_rank)
        # names a lost rank if a collective fails (process/lifecycle.py reports it); the run
        # context stops it when the run ends
        run = run_context.current()
        self._heartbeat = None if run is None else run.start_heartbeat(
            self.data_parallel_rank, self.data_parallel_world_size)

    # -- wrapping ------------------------------------------------------------------------------
    @property
    def use_distributed_wrapper(self) -> bool:
        # No DDP-style wrapper: the model is sharded in place (see `model`). True only while
        # fairseq's __init__ runs, where it means "leave the model where it is".
        return getattr(self, "_in_base_init", False)

    @property
    def model(self):
        if self._wrapped_model is None:
            self._wrapped_model = self._shard(self._model)
        return self._wrapped_model

    def _shard(self, model):
        dt = self.cfg.distributed_training
        if dt.lora_rank > 0:  # adapters on the linear modules, the rest frozen (models/lora.py)
            lora.adapt(model, dt.lora_rank, lora_scaling(dt), dt.lora_dropout, lora_modules(dt),
                       lora_train_patterns(dt), bool(getattr(dt, "lora_train_new_rows", False)))
        if tied_grad_buffer_on(dt):  # before sharding: it changes the tied modules' classes
            tied_grad_buffer.install(model)
        # --encoder/--decoder-layerdrop: every rank skips the same layers (sharding/layerdrop.py)
        layerdrop.install(model, self.cfg.common.seed)
        world = dist.get_world_size() if dist.is_initialized() else 1
        plan = build_plan(
            model, world_size=world,
            min_params_to_wrap=getattr(self.cfg.model, "min_params_to_wrap",
                                       DEFAULT_MIN_PARAMS_TO_WRAP),
            checkpoint_activations=bool(getattr(self.cfg.model, "checkpoint_activations", False)),
            no_reshard_after_forward=dt.no_reshard_after_forward,
            reshard_degree=dt.fsdp2_reshard_degree, root_reshard=dt.fsdp2_root_reshard,
            frozen_dtype=mixed_precision.compute_dtype(self.cfg.common))
        if self.is_data_parallel_master:
            logger.info("\n" + plan.table())
            for warning in plan.warnings:
                logger.warning(warning)
        self.sharding_plan = plan
        mesh = build_mesh(self.device.type, world, dt.fsdp2_replicate_degree)
        if dt.heartbeat_timeout > 0:
            # fairseq's --heartbeat-timeout: no collective waits longer than this for a peer
            restore = heartbeat.set_collective_timeout(dt.heartbeat_timeout, [
                dist.group.WORLD, distributed_utils.get_global_group(), *mesh.get_all_groups()])
            run = run_context.current()
            if run is not None and not run.owns_group:  # a caller's group outlives the run
                run.on_close(restore)
        dtype = mixed_precision.compute_dtype(self.cfg.common)
        mixed_precision.cast_float_buffers(model, dtype)
        self._store_bf16_weights(model)
        apply_plan(model, plan, mesh,
                   mp_policy=mixed_precision.mixed_precision_policy(self.cfg.common, dt),
                   cpu_offload=dt.cpu_offload)
        if meta_build.built_on_meta(model):
            meta_build.materialize(model, self.device,
                                   torch.device("cpu") if dt.cpu_offload else None)
        if plan.lora is not None:
            self._initialize_adapters(model)
        if tied_grad_reduce.applies(dt, world // dt.fsdp2_replicate_degree,
                                    max(self.cfg.optimization.update_freq)) and \
                tied_grad_reduce.install(model):
            logger.info("the tied embedding's gradient is reduced into this rank's shard as "
                        "backward starts, the looked-up rows exchanged at its end "
                        "(--fsdp2-no-tied-early-reduce turns it off)")
        model.register_load_state_dict_pre_hook(self._load_sharded_model)
        self.resolve_shards_before_the_models_own_load(model)
        if dt.fsdp2_no_sync_micro_batches:
            # fairseq's update-freq loop calls model.no_sync() on all but the last micro-batch
            # when the model has one; give the sharded model FSDP2's equivalent.
            model.no_sync = lambda: _no_gradient_sync(model)
        return model

    def _store_bf16_weights(self, model) -> None:
        """--memory-efficient-bf16: the parameters stored in bf16 before they are sharded, no
        float32 master copy (settings.keeps_bf16_weights decides, as for the optimizer, whose
        step rounds each update back stochastically, and the estimator)."""
        if keeps_bf16_weights(self.cfg):
            model.to(torch.bfloat16)
            logger.info("--memory-efficient-bf16: parameters stored in bf16 (no float32 master "
                        "copy), each update written back with stochastic rounding")
        elif getattr(self.cfg.common, "memory_efficient_bf16", False):
            logger.warning("--memory-efficient-bf16 keeps float32 master weights here, as "
                           "--bf16 does: bf16 weights need fairseq's Adam (--optimizer adam) "
                           "without --amsgrad or --fp16-adam-stats")

    def _initialize_adapters(self, model) -> None:
        """The adapters' starting values (models/lora.py: the same on every rank, from the
        seed), each rank its shard; a resumed checkpoint overwrites them."""
        own = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in lora.initial_adapters(model, self.cfg.common.seed).items():
                copy_into_shard(own[name], value.to(own[name].device, own[name].dtype))

    # -- optimizer -----------------------------------------------------------------------------
    def _build_optimizer(self):
        params = [p for p in chain(self.model.parameters(), self.criterion.parameters())
                  if p.requires_grad]
        self._optimizer = build_optimizer(self.cfg, params)
        run = run_context.current()
        if run is not None:  # the moments' kept buffers and tables go with the run
            run.on_close(release_workspaces)
        self._optimizer.optimizer.register_load_state_dict_pre_hook(self._load_sharded_optimizer)
        install_optimizer_hooks(self._optimizer.optimizer)
        if self._keeps_16_bit_grads():
            sixteen_bit_grads.keep_reduce_dtype_grads(self.model)
            logger.info("gradient shards kept in the reduce dtype (--fsdp2-reduce-dtype) for "
                        "the optimizer: 2 bytes per parameter element fewer than fp32")
        if self._in_backward is not None:  # fairseq builds the optimizer again on loading
            self._in_backward.remove()
            self._in_backward = None
        if steps_in_backward(self.cfg):  # --fsdp2-step-in-backward (optimizer/step_in_backward.py)
            self._in_backward = StepInBackward(self._optimizer)
            self._in_backward.handles.append(
                self._criterion.register_forward_hook(self._loss_computed))
            logger.info("Adam steps each parameter inside backward, as soon as FSDP2 has reduced "
                        "its gradient (--fsdp2-step-in-backward): no whole-model gradient held")
        self._lr_scheduler = lr_scheduler.build_lr_scheduler(self.cfg.lr_scheduler,
                                                             self.optimizer)
        self._lr_scheduler.step_update(0)

    def _keeps_16_bit_grads(self) -> bool:
        """Whether the sharded gradients stay in the 16-bit reduce dtype (sharding/
        sixteen_bit_grads.py) for the optimizer's step (optimizer/row_chunk_step.py):
        settings.keeps_16_bit_grads decides, as for the estimator."""
        dt = self.cfg.distributed_training
        takes = getattr(self._optimizer.optimizer, "takes_16_bit_grads", None)
        return settings.keeps_16_bit_grads(
            str(getattr(dt, "fsdp2_reduce_dtype", "fp32") or "fp32"),
            takes is not None and takes(), self.cfg.optimization.update_freq, dt.cpu_offload,
            getattr(dt, "fsdp2_fp32_grad_shards", False))

    def _prepare_sample(self, sample, is_dummy=False):
        sample, dummy = super()._prepare_sample(sample, is_dummy)
        self._dummy_sample = dummy  # the step in backward's factor counts it as fairseq does
        return sample, dummy

    def _loss_computed(self, criterion, inputs, output) -> None:
        """The criterion's forward hook under the step in backward: fairseq's factor of this
        update's gradients, world size / the sample size summed over the ranks, computed as
        train_step computes it after backward (a dummy batch counts 0; the sum all-reduced in
        float64 by fairseq's all_reduce_dict), known now, before backward: one small
        all-reduce."""
        if self._in_backward is None or not self._in_backward.armed:
            return
        sample_size = 0.0 if getattr(self, "_dummy_sample", False) else output[1]
        sample_size = sample_size.float() if torch.is_tensor(sample_size) else float(sample_size)
        if self._sync_stats():
            sample_size = distributed_utils.all_reduce_dict(
                {"sample_size": sample_size}, device=self.device,
                group=self.data_parallel_process_group)["sample_size"]
        self._in_backward.set_factor(self.data_parallel_world_size / (sample_size or 1.0))

    def clip_grad_norm(self, clip_norm):
        if self._in_backward is not None:
            self._in_backward.disarm()  # backward is over: fairseq takes the norm
        # The norm comes from optimizer/grad_norm.py (build_optimizer installs it under
        # fairseq's fp16 wrappers): the global norm over the DTensor gradients, whatever
        # fairseq's own helper would do (apex's local norms, --cpu-offload's CPU gradients).
        self.keep_pretrained_rows()  # --lora-train-new-rows (checkpoint_hooks.py)
        try:
            norm = self.optimizer.clip_grad_norm(clip_norm)
        except OverflowError:
            self._overflowed = True
            raise
        return norm

    # -- the step ------------------------------------------------------------------------------
    def _check_weights(self) -> None:
        if meta_build.built_on_meta(self._model) and not self._weights_loaded:
            raise CheckpointError("the model was built on the meta device for a checkpoint to "
                                  "fill, but no checkpoint was loaded")

    def valid_step(self, sample, raise_oom=False):
        self._check_weights()
        # --eval-bleu generates: ranks decode for different numbers of steps (units.py)
        generates = getattr(self.cfg.task, "eval_bleu", False)
        with all_unsharded(self.model) if generates else contextlib.nullcontext():
            return super().valid_step(sample, raise_oom)

    def train_step(self, samples, raise_oom=False):
        self._check_weights()
        self._overflowed = False
        if hasattr(self.criterion, "loss_scale"):  # the fused loss: fp16 gradients pre-scaled
            scaler = getattr(self.optimizer, "scaler", None)
            self.criterion.loss_scale = None if scaler is None else scaler.loss_scale
        if self._heartbeat is not None:
            self._heartbeat.num_updates = self.get_num_updates()
        if self._in_backward is not None:
            self._in_backward.arm()
        try:
            with record_update(self):  # --fsdp2-memory-breakdown N: update N only
                # raise_oom: fairseq would skip the batch and go on, but the other ranks are
                # inside this step's collectives: stop (with the figures to act on) instead.
                logging_output = super().train_step(samples, raise_oom=True)
        except Exception as e:
            if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e):
                update = self.get_num_updates() + 1
                raise OutOfMemory(
                    f"out of memory on rank {self.data_parallel_rank} at update {update}: "
                    f"{first_line(e)}; {describe_last(self._memory)}. See where "
                    f"it goes with --fsdp2-memory-breakdown {update} (and a smaller "
                    f"--max-tokens to get there)") from e
            # NaN/Inf gradients or the loss-scale floor stop every rank: say where. (fairseq
            # then re-runs the step under its NanDetector, whose hooks fail on current torch;
            # report the FloatingPointError, not that.)
            cause = _in_context(e, FloatingPointError)
            if cause is not None:
                raise FloatingPointError(f"{cause} (at update {self.get_num_updates() + 1}, "
                                         f"rank {self.data_parallel_rank})") from e
            if not isinstance(e, (AssertionError, RuntimeError)):
                raise
            # fairseq's overflow branch ends with torch.tensor(0.0).cuda(), which raises without
            # CUDA; finish the skipped step the way fairseq does on GPUs.
            if not self._overflowed or self.cuda:
                raise
            logging_output = self._skip_overflowed_step()
        finally:
            if self._in_backward is not None:
                self._in_backward.disarm()
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

    # -- data ----------------------------------------------------------------------------------
    def get_train_iterator(self, epoch, combine=True, load_dataset=True, data_selector=None,
                           shard_batch_itr=True, disable_iterator_cache=False):
        # a resumed run batches the data as the uninterrupted run did (resume.py)
        resuming, self._iterator_built = not getattr(self, "_iterator_built", False), True
        with resume.batches_as_first_built(self.task, self.cfg, epoch, disable_iterator_cache,
                                           resuming):
            return super().get_train_iterator(epoch, combine, load_dataset, data_selector,
                                              shard_batch_itr, disable_iterator_cache)


def _in_context(error: BaseException, kind: type):
    """``error`` or the exception it was raised while handling, if of ``kind``."""
    while error is not None:
        if isinstance(error, kind):
            return error
        error = error.__context__
    return None


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
    if cfg.distributed_training.ddp_backend == FSDP2_BACKEND:
        return FSDP2Trainer(cfg, task, model, criterion, quantizer)
    return Trainer(cfg, task, model, criterion, quantizer)
