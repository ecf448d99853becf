"""Bad input caught before work starts, or recognised when fairseq trips over it.

``check_launch`` runs before the process group exists: a world size that the processes on
hand cannot form, a --save-dir that cannot be created, a --finetune-from-model that is not there
(or a directory without Hugging Face weights). ``check_options``: the plugin's options and
fairseq's flags (``check_fairseq_flags``: fairseq flags FSDP2 runs do not serve, an
--ema-seed-model without an EMA, and fairseq numbers out of their range).
``weights_will_be_loaded``: whether the model can be built on the meta device. ``data_error``
turns fairseq's own errors for a data directory without the files asked for (raised while the
task loads, on every rank alike) into one line.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Optional

import torch

from ..checkpoint import sharded
from ..checkpoint.safe_load import read_checkpoint_file
from ..errors import CheckpointError, OptionError, first_line, unwritable
from ..hf.nllb_weights import INDEX, WEIGHTS, is_hf_source
from ..optimizer.build import step_in_backward_conflict
from ..options import FSDP2_BACKEND, LEGACY_FSDP_BACKEND, validate

logger = logging.getLogger(__name__)


def trains_with_fsdp2(cfg) -> bool:
    """Whether the run trains with FSDP2, its backend flags settled: ``--ddp-backend
    fully_sharded`` (legacy, fairscale) becomes ``fsdp2``, and the ``--tpu`` fairseq makes of
    ``--bf16`` is taken back; a real ``--tpu`` raises OptionError. Used by the run's setup
    (process/setup.py) and by the check before torchrun starts (before_torchrun.py)."""
    dt = cfg.distributed_training
    if dt.ddp_backend == LEGACY_FSDP_BACKEND:
        logger.info("--ddp-backend fully_sharded is served by PyTorch FSDP2 (fairseq_fsdp2); "
                    "fairscale is not used")
        dt.ddp_backend = FSDP2_BACKEND
    if dt.ddp_backend != FSDP2_BACKEND:
        return False
    if cfg.common.tpu:
        if not cfg.common.bf16:
            raise OptionError("--tpu cannot be combined with --ddp-backend fsdp2")
        # fairseq turns --bf16 into --tpu (bf16 was TPU-only there); FSDP2 serves bf16 itself.
        cfg.common.tpu = False
        dt.tpu = False
    return True


def check_launch(cfg, *, launched_per_rank: bool, on_cuda: bool) -> None:
    """Raise OptionError for a run that cannot start as asked."""
    world = cfg.distributed_training.distributed_world_size
    if world > 1 and not launched_per_rank:
        devices = torch.cuda.device_count() if on_cuda else 0
        if world > devices:
            where = f"{devices} GPU(s) here" if on_cuda else "CPU (--cpu or no GPU)"
            raise OptionError(
                f"--distributed-world-size {world} needs one process per rank and there is "
                f"{where}: start the ranks with torchrun --nproc_per_node {world} (or SLURM) "
                f"and leave out the distributed flags")
    source = cfg.checkpoint.finetune_from_model
    if source and os.path.isdir(source) and not is_hf_source(source):
        raise OptionError(f"--finetune-from-model {source} is a directory without a Hugging "
                          f"Face model in it (config.json and {WEIGHTS} or {INDEX})")
    if source and not os.path.exists(source):  # fairseq would stop later with a traceback
        raise OptionError(f"--finetune-from-model not found: {source}")
    save_dir = cfg.checkpoint.save_dir
    problem = None if cfg.checkpoint.no_save else unwritable(save_dir)
    if problem:
        raise OptionError(f"--save-dir {save_dir} cannot be written: {problem}")


def weights_will_be_loaded(cfg) -> bool:
    """True if fairseq-train will load model weights before training: a fine-tuning source,
    or an existing checkpoint to resume (fairseq's --restore-file resolution)."""
    ckpt = cfg.checkpoint
    if ckpt.finetune_from_model:
        return True
    if os.path.isfile(sharded.restore_path(ckpt)):
        return True
    # the trainer's rule: without checkpoint_last, a newer complete update checkpoint
    return ckpt.restore_file == sharded.DEFAULT_RESTORE_FILE and \
        sharded.newest_complete(ckpt.save_dir, suffix=ckpt.checkpoint_suffix) is not None



#: fairseq's numeric flags that fairseq takes without a look and then trips over (a traceback
#: mid-run, a crash of its C code, or a run that stops at once having done nothing): (config
#: group, key, flag, least value, most value or None, what 0 means where it is allowed)
NUMBER_RANGES = (
    ("dataset", "max_tokens", "--max-tokens", 1, None, ""),
    ("dataset", "batch_size", "--batch-size", 1, None, ""),
    ("dataset", "max_tokens_valid", "--max-tokens-valid", 1, None, ""),
    ("dataset", "batch_size_valid", "--batch-size-valid", 1, None, ""),
    ("dataset", "required_batch_size_multiple", "--required-batch-size-multiple", 1, None, ""),
    ("dataset", "num_workers", "--num-workers", 0, None, ""),
    ("dataset", "validate_interval", "--validate-interval", 1, None, ""),
    ("optimization", "update_freq", "--update-freq", 1, None, ""),
    ("optimization", "max_update", "--max-update", 0, None, " (0: no limit)"),
    ("optimization", "max_epoch", "--max-epoch", 0, None, " (0: no limit)"),
    ("optimization", "lr", "--lr", 0, None, ""),
    ("common", "log_interval", "--log-interval", 1, None, ""),
    ("checkpoint", "save_interval", "--save-interval", 1, None, ""),
    ("lr_scheduler", "warmup_updates", "--warmup-updates", 0, None, ""),
    ("task", "max_source_positions", "--max-source-positions", 1, None, ""),
    ("task", "max_target_positions", "--max-target-positions", 1, None, ""),
    ("model", "dropout", "--dropout", 0, 1, ""),
    ("model", "attention_dropout", "--attention-dropout", 0, 1, ""),
    ("model", "activation_dropout", "--activation-dropout", 0, 1, ""),
)


def check_numbers(cfg) -> None:
    """Raise OptionError for a fairseq number out of its range (NUMBER_RANGES), naming the
    flag, its range and the value given. None (not given) and absent keys pass."""
    for group, key, flag, least, most, zero in NUMBER_RANGES:
        given = getattr(getattr(cfg, group, None), key, None)
        several = isinstance(given, Sequence) and not isinstance(given, str)  # --lr 0.1,0.01
        for value in given if several else [given]:
            if not isinstance(value, (int, float)) or least <= value and (
                    most is None or value <= most):
                continue
            shown = ",".join(f"{v:g}" for v in given) if several else f"{value:g}"
            wanted = f"between {least} and {most}" if most is not None else f">= {least}"
            raise OptionError(f"{flag} must be {wanted}{zero}, got {shown}")


def check_options(cfg) -> None:
    """Raise OptionError for bad options of an FSDP2 run, once its world size is known: the
    plugin's (options.validate) and fairseq's flags (check_fairseq_flags)."""
    dt = cfg.distributed_training
    validate(dt, min_params_to_wrap=getattr(cfg.model, "min_params_to_wrap", 0),
             fp16=cfg.common.fp16, bf16=cfg.common.bf16,
             world_size=dt.distributed_world_size,
             optimizer=getattr(cfg.optimizer, "_name", None),  # a Namespace for some
             fp16_adam_stats=bool(getattr(cfg.optimizer, "fp16_adam_stats", False)))
    decay = float(getattr(cfg.optimizer, "weight_decay", 0.0) or 0.0)
    if getattr(dt, "lora_train_new_rows", False) and decay > 0:
        raise OptionError(f"--lora-train-new-rows keeps the pretrained rows as they are, which "
                          f"--weight-decay {decay:g} would shrink: choose one")
    if getattr(dt, "fsdp2_step_in_backward", False):
        conflict = step_in_backward_conflict(cfg)
        if conflict is not None:
            raise OptionError(f"--fsdp2-step-in-backward {conflict}")
    check_fairseq_flags(cfg)


def check_fairseq_flags(cfg) -> None:
    """Raise OptionError for a fairseq flag FSDP2 runs do not serve (each says why), or a
    fairseq number out of its range (check_numbers)."""
    check_numbers(cfg)
    dt = cfg.distributed_training
    if cfg.common.amp:
        raise OptionError("--amp cannot be combined with --ddp-backend fsdp2: use --fp16 or "
                          "--bf16 (FSDP2 mixed precision: fp32 master weights, fp16/bf16 "
                          "compute)")
    for flag, name in ((cfg.optimization.use_bmuf, "--use-bmuf"),
                       (dt.zero_sharding != "none", "--zero-sharding"),
                       (cfg.common.model_parallel_size > 1, "--model-parallel-size > 1")):
        if flag:
            raise OptionError(f"{name} cannot be combined with --ddp-backend fsdp2")
    seed = cfg.ema.ema_seed_model if cfg.ema.store_ema else None
    if seed:  # fairseq would stop at the first update, with a traceback
        if not os.path.isfile(seed):
            raise OptionError(f"--ema-seed-model not found: {seed}")
        try:
            saved = (read_checkpoint_file(seed).get("extra_state") or {}).get("ema")
        except CheckpointError as e:
            raise OptionError(f"--ema-seed-model: {e}") from e
        if not saved:
            raise OptionError(f"--ema-seed-model {seed} holds no EMA (extra_state['ema']): was "
                              f"it trained with --store-ema?")


def data_error(error: BaseException, data: Optional[str]) -> Optional[str]:
    """One line for fairseq's missing-data errors, or None if ``error`` is something else."""
    text = first_line(error, None)
    hint = "check DATA and --source-lang/--target-lang (or --lang-pairs)"
    if isinstance(error, FileNotFoundError):
        if error.filename is None and text.startswith("Dataset not found"):
            return f"data not found: {text}; {hint}"
        if error.filename and data and os.path.abspath(error.filename).startswith(
                tuple(os.path.abspath(d) for d in data.split(os.pathsep))):
            return f"data not found: {error.filename}; {hint}"
    if "Could not infer language pair" in text:
        return f"data in {data} holds no language pair fairseq can infer: {hint}"
    return None


def check_fsdp2_only_options(cfg) -> None:
    """The plugin's options whose names do not say FSDP2 (``--bf16-adam-stats``,
    ``--eight-bit-adam-stats``, ``--init-new-langs-from``, ``--lora-rank``), given to another backend, which
    would ignore them: refused."""
    dt = cfg.distributed_training
    for key, flag in (("bf16_adam_stats", "--bf16-adam-stats"),
                      ("eight_bit_adam_stats", "--eight-bit-adam-stats"),
                      ("init_new_langs_from", "--init-new-langs-from"),
                      ("lora_rank", "--lora-rank")):
        if getattr(dt, key, None):
            raise OptionError(f"{flag} needs --ddp-backend fsdp2: --ddp-backend "
                              f"{dt.ddp_backend} would ignore it")


def check_other_backend_restore(cfg) -> None:
    """A run of another backend (legacy_ddp, ...) resuming an FSDP2 checkpoint with its
    optimizer state: fairseq gets the full weights (integration/registration.py's patch 8), but the
    optimizer state is FSDP2's shards, which fairseq's optimizers cannot load (it would stop
    with ``KeyError: 'param_groups'`` after building everything)."""
    ckpt = cfg.checkpoint
    if ckpt.reset_optimizer:
        return
    path = sharded.restore_path(ckpt)
    if not os.path.isfile(path):
        return
    try:
        saved_by_fsdp2 = "fsdp2" in read_checkpoint_file(path)  # memory-mapped: a cheap look
    except CheckpointError:
        return  # not ours to judge: fairseq reads it (and says what is wrong)
    if saved_by_fsdp2:
        raise OptionError(
            f"{path} is an FSDP2 checkpoint: its optimizer state is in shards that "
            f"--ddp-backend {cfg.distributed_training.ddp_backend} cannot load; resume it with "
            f"--ddp-backend fsdp2, or add --reset-optimizer to go on from its weights with a "
            f"new optimizer")
