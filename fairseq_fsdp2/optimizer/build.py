"""The optimizer over FSDP2's sharded fp32 parameters: fairseq's own, with what DTensor
parameters need.

fp16 keeps fairseq's dynamic loss scaling (``--fp16-init-scale``, ``--fp16-scale-window``,
``--min-loss-scale``) through fairseq's own ``MemoryEfficientFP16Optimizer``, which scales the loss
and unscales the (sharded) gradients.
"""
from __future__ import annotations

import copy
import logging
from typing import Optional

from fairseq import optim
from omegaconf import OmegaConf, open_dict

from .. import settings
from .adafactor_state import use_factored_state
from .adam_stats import use_16_bit_moments
from .grad_norm import use_global_grad_norm
from .local_shard_step import use_local_shards

logger = logging.getLogger(__name__)


def adam_stats(cfg) -> str:
    """How Adam's moments are stored between steps: ``fp16`` (--fp16-adam-stats), ``bf16``
    (--bf16-adam-stats), ``8bit`` (--eight-bit-adam-stats) or ``fp32`` (settings.
    moment_format decides)."""
    return settings.moment_format(
        getattr(cfg.optimizer, "fp16_adam_stats", False),  # a Namespace for some optimizers
        OmegaConf.select(cfg, "distributed_training.bf16_adam_stats", default=False),
        OmegaConf.select(cfg, "distributed_training.eight_bit_adam_stats", default=False))


def keeps_bf16_weights(cfg, local_shards: bool = True) -> bool:
    """Whether this run keeps its sharded parameters in bf16 with no float32 master copy
    (--memory-efficient-bf16 with fairseq's Adam: settings.keeps_bf16_weights decides, for the
    trainer, which casts the model, and for the step, which rounds the updates back)."""
    return settings.keeps_bf16_weights(
        bool(OmegaConf.select(cfg, "common.memory_efficient_bf16", default=False)),
        settings.step_takes_16_bit_grads(
            str(getattr(cfg.optimizer, "_name", None) or ""), adam_stats(cfg),
            bool(getattr(cfg.optimizer, "amsgrad", False)), local_shards))


def step_in_backward_conflict(cfg) -> Optional[str]:
    """Why this run cannot step Adam inside backward exactly as after it, or None where it can
    (settings.step_in_backward_conflict decides: for the preflight check, which refuses
    --fsdp2-step-in-backward with it, the trainer and the estimator)."""
    common, optimization = cfg.common, cfg.optimization
    return settings.step_in_backward_conflict(
        str(getattr(cfg.optimizer, "_name", None) or ""), adam_stats(cfg),
        bool(getattr(cfg.optimizer, "amsgrad", False)), float(optimization.clip_norm or 0),
        optimization.update_freq,
        bool(common.fp16 or getattr(common, "memory_efficient_fp16", False)),
        bool(OmegaConf.select(cfg, "distributed_training.cpu_offload", default=False)),
        bool(OmegaConf.select(cfg, "distributed_training.lora_train_new_rows", default=False)))


def steps_in_backward(cfg) -> bool:
    """Whether this run steps Adam inside backward: --fsdp2-step-in-backward where nothing
    conflicts (step_in_backward_conflict; the preflight check refuses the rest)."""
    return bool(OmegaConf.select(cfg, "distributed_training.fsdp2_step_in_backward",
                                 default=False)) and step_in_backward_conflict(cfg) is None


def build_optimizer(cfg, params, local_shards: bool = True):
    """fairseq's optimizer over the sharded fp32 parameters; fp16 adds the loss scaler.

    Two GPU-only choices of fairseq are undone for DTensor parameters: with apex installed,
    fairseq's Adam becomes apex's FusedAdam, whose kernels take plain CUDA tensors (not
    DTensors, not offloaded CPU shards): ``use_old_adam`` keeps fairseq's own Adam, as on
    machines without apex. And the gradient norm is the global one over DTensor gradients
    (grad_norm.py), whatever fairseq's helper would compute; elementwise work (Adam's step,
    scaling the gradients) runs on the local shards (local_shard_step.py; ``local_shards=False``
    leaves it to DTensor dispatch, the reference the tests and the benchmark compare with);
    Adafactor's factored statistics are made DTensors (adafactor_state.py); Adam's moments are
    kept in 16 bits with ``--fp16-adam-stats`` (fairseq's FusedAdamV1 only: on fairseq's own
    Adam it raises NotImplementedError) or ``--bf16-adam-stats``, in 8 bits with
    ``--eight-bit-adam-stats`` (adam_stats.py; the formats: moments/)."""
    optimizer_cfg = cfg.optimizer
    stats = adam_stats(cfg)
    if "use_old_adam" in optimizer_cfg:
        optimizer_cfg = copy.deepcopy(optimizer_cfg)  # the run's saved cfg stays the user's
        with open_dict(optimizer_cfg):
            optimizer_cfg.use_old_adam = True
            if "fp16_adam_stats" in optimizer_cfg:
                optimizer_cfg.fp16_adam_stats = False  # done here instead, on the shards
    inner = optim.build_optimizer(optimizer_cfg, params)
    use_global_grad_norm(inner, local_shards)
    if local_shards:
        use_local_shards(inner.optimizer)  # elementwise optimizers step on the local shards
    use_factored_state(inner.optimizer)  # Adafactor: its row and column statistics sharded
    seed = OmegaConf.select(cfg, "common.seed", default=1)
    if use_16_bit_moments(inner.optimizer, stats, local_shards, seed=seed,
                          bf16_weights=keeps_bf16_weights(cfg, local_shards)) and stats != "fp32":
        flag, saving = {"8bit": ("eight-bit", "about a quarter of")}.get(stats, (stats, "half"))
        logger.info(f"Adam's moments kept in {stats} between steps (--{flag}-adam-stats): "
                    f"{saving} the optimizer state")
    if cfg.common.fp16:
        # After loading optimizer state, fairseq's wrapper copies the saved state back over
        # what torch loaded, lest torch cast it to fp16 parameters. Here the parameters are
        # fp32 and the saved state a reference to the shards (no "param_groups": resuming
        # an --fp16 run failed with a KeyError): its own switch turns that copy off.
        inner.optimizer.disable_mem_eff_fp16_loading_hack = True
        # allow_unsupported: the parameters are fp32 master weights, so any fairseq optimizer
        # is valid under the scaler (the same choice fairseq makes for legacy FSDP + --fp16).
        return optim.MemoryEfficientFP16Optimizer(cfg, params, inner, allow_unsupported=True)
    return inner
