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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from . import liveness, meta_init, precision, resume, tied_grad
from .apply import all_unsharded, apply_plan, build_mesh
from .checkpoint import hf_nllb, sharded
from .checkpoint.safe_load import python_numbers, read_checkpoint_file
from .checkpoint.shared_dir import check_shared
from .checkpoint.full_state import broadcast_full_model, install_optimizer_hooks
from .errors import CheckpointError, OutOfMemory, SaveFailed, first_line
from .memory import MemoryMonitor
from .memory.monitor import current_gb, describe_last
from .memory.breakdown import record_update
from .options import tied_grad_buffer
from .plan import ShardingPlan, build_plan

logger = logging.getLogger(__name__)

DEFAULT_MIN_PARAMS_TO_WRAP = int(1e8)  # fairseq's default


class FSDP2Trainer(Trainer):
    """Trains a model sharded with FSDP2 (``--ddp-backend fsdp2``)."""

    def __init__(self, cfg, task, model, criterion, quantizer=None):
        # fairseq's Trainer.__init__ casts the model to fp16/bf16 and refuses --cpu-offload unless
        # the backend is fairscale's. Here the sharded fp32 parameters are the master weights
        # (precision.py) and --cpu-offload maps to FSDP2's offload, so hide those flags from it.
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
        self._loading_from: str | None = None  # the checkpoint file being loaded
        self._shards: str | None = None  # written by consolidate_optimizer, for state_dict
        self._memory = MemoryMonitor(
            self.device,
            None if cfg.checkpoint.no_save else os.path.join(cfg.checkpoint.save_dir,
                                                             "memory.jsonl"),
            rank=self.data_parallel_rank)
        # names a lost rank if a collective fails (launch.py reports it)
        self._heartbeat = liveness.start(self.data_parallel_rank, self.data_parallel_world_size)

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
        if tied_grad_buffer(dt):  # before sharding: it changes the tied modules' classes
            tied_grad.install(model)
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
        if dt.heartbeat_timeout > 0:
            # fairseq's --heartbeat-timeout: no collective waits longer than this for a peer
            liveness.set_collective_timeout(dt.heartbeat_timeout, [
                dist.group.WORLD, distributed_utils.get_global_group(), *mesh.get_all_groups()])
        dtype = precision.compute_dtype(self.cfg.common)
        precision.cast_float_buffers(model, dtype)
        apply_plan(model, plan, mesh, mp_policy=precision.mixed_precision_policy(self.cfg.common),
                   cpu_offload=dt.cpu_offload)
        if meta_init.built_on_meta(model):
            meta_init.materialize(model, self.device,
                                  torch.device("cpu") if dt.cpu_offload else None)
        model.register_load_state_dict_pre_hook(self._load_sharded_model)
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
        self._optimizer.optimizer.register_load_state_dict_pre_hook(self._load_sharded_optimizer)
        install_optimizer_hooks(self._optimizer.optimizer)
        self._lr_scheduler = lr_scheduler.build_lr_scheduler(self.cfg.lr_scheduler,
                                                             self.optimizer)
        self._lr_scheduler.step_update(0)

    def clip_grad_norm(self, clip_norm):
        # The norm comes from grad_norm.py (precision.build_optimizer installs it under
        # fairseq's fp16 wrappers): the global norm over the DTensor gradients, whatever
        # fairseq's own helper would do (apex's local norms, --cpu-offload's CPU gradients).
        try:
            norm = self.optimizer.clip_grad_norm(clip_norm)
        except OverflowError:
            self._overflowed = True
            raise
        return norm

    # -- the step ------------------------------------------------------------------------------
    def _check_weights(self) -> None:
        if meta_init.built_on_meta(self._model) and not self._weights_loaded:
            raise CheckpointError("the model was built on the meta device for a checkpoint to "
                                  "fill, but no checkpoint was loaded")

    def valid_step(self, sample, raise_oom=False):
        self._check_weights()
        # --eval-bleu generates: ranks decode for different numbers of steps (apply.py)
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

    # -- checkpoints ---------------------------------------------------------------------------
    # fairseq's own save/load code runs unchanged; the model and optimizer entries of its
    # checkpoint file (written by rank 0) reference a DCP shard directory
    # (checkpoint/sharded.py), written by every rank and read back by the hooks below, at any
    # world size.
    def consolidate_optimizer(self):
        """Write the shards. fairseq calls this on every rank at every save point (after its
        --no-save check, before deciding which files to write, and before a crash.pt), so
        the collective write happens on all ranks even when rank 0 then writes no file;
        ``state_dict()`` on the saving rank only references the result."""
        # Units that keep their parameters gathered after forward (root and shared embedding
        # with --fsdp2-root-reshard default) are still unsharded after validation's
        # forward-only pass; their entries would be plain tensors whose storage the next
        # reshard frees. Reshard everything first.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        self._gathered_optim_state = None  # fairseq's state_dict() reads it
        save_dir = self.cfg.checkpoint.save_dir
        if self.data_parallel_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            sharded.remove_unreferenced(save_dir)
        keep_optimizer = not self.cfg.checkpoint.no_save_optimizer_state
        with self._save_errors_reported():
            self._shards = sharded.save(self.model,
                                        self.optimizer.optimizer if keep_optimizer else None,
                                        save_dir, self.get_num_updates())

    def save_checkpoint(self, filename, extra_state):
        resume.save_patience(self.cfg, extra_state)
        with self._save_errors_reported():
            super().save_checkpoint(filename, python_numbers(extra_state))

    @contextlib.contextmanager
    def _save_errors_reported(self):
        """A failed write (disk full, unwritable directory) stops training with one line;
        shards and files are written under temporary names, so earlier checkpoints are intact."""
        try:
            yield
        except (OSError, CheckpointException) as e:
            raise SaveFailed(
                f"saving the checkpoint of update {self.get_num_updates()} to "
                f"{self.cfg.checkpoint.save_dir} failed on rank {self.data_parallel_rank}: "
                f"{_save_error(e)}; the previous checkpoints are intact") from e

    def state_dict(self):
        if self._shards is None:
            raise RuntimeError("state_dict() needs consolidate_optimizer() first, on every "
                               "rank: the shards are written collectively there")
        rel, self._shards = self._shards, None
        state = super().state_dict()  # model and optimizer entries are cheap shard references
        buffers = {k: v for k, v in state["model"].items() if not isinstance(v, DTensor)}
        state["model"] = {sharded.SHARDED: rel, **buffers}  # buffers: tiny, for fairseq's upgrade
        if "last_optimizer_state" in state:
            scale = state["last_optimizer_state"].get("loss_scale")
            state["last_optimizer_state"] = {sharded.SHARDED: rel,
                                             **({"loss_scale": scale} if scale else {})}
        state["fsdp2"] = sharded.header(self.model, rel, self.data_parallel_world_size)
        return python_numbers(state)  # fairseq keeps e.g. the best BLEU as a numpy scalar

    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False,
                        optimizer_overrides=None, reset_meters=False):
        info = None
        if not self.cfg.checkpoint.no_save:  # fairseq calls this once, at start, on every rank
            check_shared(self.cfg.checkpoint.save_dir)  # before anything is read or written
        if hf_nllb.is_hf_source(filename):  # --finetune-from-model of Hugging Face weights
            return self._load_pretrained(filename)
        filename = self._newest_complete(filename)
        if not os.path.isfile(filename) and \
                self.cfg.checkpoint.restore_file != sharded.DEFAULT_RESTORE_FILE:
            # fairseq would silently start from scratch; a named restore file must exist
            raise CheckpointError(f"--restore-file not found: {filename}")
        if os.path.isfile(filename):
            state = read_checkpoint_file(filename)  # memory-mapped: a cheap look
            info = state.get("fsdp2")
            if info is not None:
                shard_dir = sharded.resolve(filename, info["shards"])
                saved = sharded.saved_shapes(sharded.read_metadata(shard_dir, filename))
            else:
                saved = {k: tuple(v.shape) for k, v in state["model"].items()
                         if torch.is_tensor(v)}
            sharded.check_model_matches(self.model, saved, filename)
            del state
            if info is None and reset_optimizer and reset_lr_scheduler and reset_meters \
                    and self.data_parallel_world_size > 1:
                return self._load_pretrained(filename)
        self._loading_from = filename
        try:
            extra_state = super().load_checkpoint(filename, reset_optimizer, reset_lr_scheduler,
                                                  optimizer_overrides, reset_meters)
        finally:
            self._loading_from = None
        self._weights_loaded = self._weights_loaded or os.path.isfile(filename)
        if info is not None and extra_state is not None:
            resume.rescale_iterator_position(extra_state, info["world_size"],
                                             self.data_parallel_world_size)
        if extra_state is not None and not (reset_optimizer or reset_meters):
            resume.restore_patience(extra_state)  # as fairseq restores the best score
        return extra_state

    def _newest_complete(self, filename: str) -> str:
        """fairseq resumes from checkpoint_last.pt. A save cut short after writing
        checkpoint_<epoch>_<updates>.pt whole, but before copying it to checkpoint_last.pt,
        leaves a newer complete checkpoint: resume from that one (lose nothing saved)."""
        if self.cfg.checkpoint.restore_file != sharded.DEFAULT_RESTORE_FILE or \
                not os.path.basename(filename).startswith("checkpoint_last"):
            return filename
        last = sharded.saved_updates(filename) if os.path.isfile(filename) else -1
        newer = sharded.newest_complete(os.path.dirname(filename), newer_than=last,
                                        suffix=self.cfg.checkpoint.checkpoint_suffix)
        if newer is None:
            return filename
        updates, path = newer
        logger.info(f"{path} (update {updates}) is newer than {filename} (update {last}), "
                    f"whose save was cut short: resuming from it")
        return path

    def _load_pretrained(self, filename):
        """A stock (consolidated) checkpoint or Hugging Face NLLB weights for fine-tuning
        (--finetune-from-model): rank 0 reads it memory-mapped and broadcasts one tensor at a
        time; every rank keeps only its shards, so no rank but 0 ever holds the full model.
        Training starts fresh (the optimizer, lr scheduler, meters and data loader are reset,
        as fairseq does)."""
        self._memory.reset()
        before = current_gb(self.device)
        full, problem = None, None
        if self.data_parallel_rank == 0:
            try:
                full = self._pretrained_weights(filename)
            except CheckpointError as e:  # told to every rank by the broadcast
                problem = str(e)
        broadcast_full_model(self.model, full, filename, problem)
        self._weights_loaded = True
        del full
        ranks = self._memory.gather({"before_gb": before,
                                     "startup_gb": self._memory.startup_peak_gb})
        logger.info(f"loaded pretrained weights from {filename}; memory per rank before -> peak "
                    f"during the load (GB): " + ", ".join(
                        f"{r['before_gb']:.3f} -> {r['peak_gb']:.3f}" for r in ranks) +
                    "; peak while building the model: " + ", ".join(
                        f"{r['startup_gb']:.3f}" for r in ranks))
        return None

    def _pretrained_weights(self, filename):
        """Rank 0: the full model's tensors by fairseq name, memory-mapped."""
        if hf_nllb.is_hf_source(filename):
            shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
            return hf_nllb.open_checked(filename, self.cfg.model, shapes,
                                        self.task.source_dictionary.symbols)
        return read_checkpoint_file(filename)["model"]

    def _load_sharded_model(self, module, state_dict, prefix, *_):
        if prefix or sharded.SHARDED not in state_dict:
            return
        sharded.load_model(module, sharded.resolve(self._loading_from,
                                                   state_dict[sharded.SHARDED]))
        state_dict.clear()
        state_dict.update(module.state_dict())

    def _load_sharded_optimizer(self, optimizer, state_dict):
        if sharded.SHARDED not in state_dict:
            return None
        sharded.load_optimizer(self.model, optimizer, sharded.resolve(
            self._loading_from, state_dict[sharded.SHARDED]))
        return optimizer.state_dict()


def _save_error(error: BaseException) -> str:
    """What a failed save reports; for DCP's CheckpointException, which wraps each rank's
    failure, the first failing rank's error."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items())
        return f"{first_line(cause, 300)} (rank {rank}'s write)"
    return first_line(error, 300)


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
    from .options import FSDP2_BACKEND
    if cfg.distributed_training.ddp_backend == FSDP2_BACKEND:
        return FSDP2Trainer(cfg, task, model, criterion, quantizer)
    return Trainer(cfg, task, model, criterion, quantizer)
