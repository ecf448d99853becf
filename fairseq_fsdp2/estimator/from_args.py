"""fairseq-train's arguments (parsed by fairseq's parser, with the plugin's options and the
estimator's own, ``python -m fairseq_fsdp2.estimate``) turned into the estimator's setup and the
model's profile, built on the meta device."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
from fairseq import options, tasks
from fairseq.data import Dictionary

from .. import settings
from ..command_line import preflight
from ..sharding import tied_grad_reduce
from ..errors import OptionError
from ..options import (FSDP2_BACKEND, LEGACY_FSDP_BACKEND, check_reduce_dtype,
                       tied_grad_buffer_on)
from . import lora
from .ledger import Setup
from .model_profile import ModelProfile, build_profile, workload_for
from .peak import CPU_BASELINE_GB, Estimate, estimate

DEFAULT_SEQ_LEN = 128
DDP_BACKENDS = ("legacy_ddp", "no_c10d")


def add_estimator_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("memory estimate (python -m fairseq_fsdp2.estimate)")
    group.add_argument("--world-size", type=int, nargs="+", default=None,
                       help="number of ranks; several values print one row each "
                            "(default: --distributed-world-size)")
    group.add_argument("--replicate-degree", type=int, default=None,
                       help="HSDP replicas (default: --fsdp2-replicate-degree)")
    group.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="cpu: peak resident memory incl. the runtime baseline; cuda: "
                            "allocator peak (default: cpu with --cpu, else cuda)")
    group.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                       help="tokens per sentence, source and target (default 128)")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="dictionary size to build the model with, instead of DATA's")
    group.add_argument("--fit-gb", type=float, default=None, metavar="GIB",
                       help="also print, for each world size, the largest --max-tokens whose "
                            "predicted per-rank peak is at most GIB")
    group.add_argument("--cpu-baseline-gb", type=float, default=None,
                       help=f"CPU runtime baseline in GiB (default: {CPU_BASELINE_GB} plus the "
                            f"dictionaries, measured on this project's machine)")


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = options.get_training_parser()
    add_estimator_args(parser)
    return options.parse_args_and_arch(parser, list(argv) if argv is not None else None)


def precision_of(args) -> str:
    if getattr(args, "bf16", False) or getattr(args, "memory_efficient_bf16", False):
        return "bf16"
    if getattr(args, "fp16", False) or getattr(args, "memory_efficient_fp16", False):
        return "fp16"
    return "fp32"


def backend_of(args) -> str:
    backend = args.ddp_backend
    if backend in (FSDP2_BACKEND, LEGACY_FSDP_BACKEND):
        return "fsdp2"
    if backend in DDP_BACKENDS:
        return "legacy_ddp"
    raise OptionError(f"--ddp-backend {backend} is not modelled (use fsdp2, fully_sharded or "
                      f"legacy_ddp)")


def adam_stats_of(args) -> str:
    """fairseq's --fp16-adam-stats (stock fairseq's FusedAdamV1 on GPUs too), the plugin's
    --bf16-adam-stats and --eight-bit-adam-stats (FSDP2 runs only: training refuses them with
    another backend)."""
    def plugin(flag: str) -> bool:
        return bool(getattr(args, flag, False)) and backend_of(args) == "fsdp2"
    return settings.moment_format(bool(getattr(args, "fp16_adam_stats", False)),
                                  plugin("bf16_adam_stats"), plugin("eight_bit_adam_stats"))


def ema_bytes_of(args) -> int:
    """Bytes per parameter element that --store-ema's EMA holds between updates. FSDP2
    (trainer/ema.py): a copy of the shards in the compute dtype, or float32 with --ema-fp32.
    Stock fairseq's EMA: a deep copy of the model (in the compute dtype: fairseq halves the
    model for --fp16/--bf16), and with --ema-fp32 a float32 copy of it as well (none when the
    model is float32 already: ``Tensor.float()`` returns the tensor itself)."""
    if not getattr(args, "store_ema", False):
        return 0
    compute = 4 if precision_of(args) == "fp32" else 2
    fp32 = bool(getattr(args, "ema_fp32", False))
    if backend_of(args) == "fsdp2":
        return 4 if fp32 else compute
    return compute + (4 if fp32 and compute != 4 else 0)


def reduce_dtype_of(args) -> str:
    """--fsdp2-reduce-dtype (FSDP2 only; training refuses a 16-bit one that is not the compute
    dtype, options.check_reduce_dtype, and so does the estimate)."""
    if backend_of(args) != "fsdp2":
        return "fp32"
    reduce = str(getattr(args, "fsdp2_reduce_dtype", "fp32") or "fp32")
    check_reduce_dtype(reduce, fp16=precision_of(args) == "fp16",
                       bf16=precision_of(args) == "bf16")  # OptionError: the estimate's too
    return reduce


def narrow_grads_of(args) -> bool:
    """Whether the trainer keeps the gradient shards in the 16-bit reduce dtype: the trainer's
    rule (settings.keeps_16_bit_grads, for a step that takes them: settings.
    step_takes_16_bit_grads), from the command line's options."""
    return settings.keeps_16_bit_grads(
        reduce_dtype_of(args),
        settings.step_takes_16_bit_grads(getattr(args, "optimizer", "adam") or "adam",
                                         adam_stats_of(args), getattr(args, "amsgrad", False)),
        getattr(args, "update_freq", None), bool(getattr(args, "cpu_offload", False)),
        bool(getattr(args, "fsdp2_fp32_grad_shards", False)))


def bf16_weights_of(args) -> bool:
    """Whether the trainer stores the sharded parameters in bf16 with no fp32 master copy: the
    trainer's rule (settings.keeps_bf16_weights: --memory-efficient-bf16, FSDP2 only, for a
    step that can take them: settings.step_takes_16_bit_grads)."""
    return backend_of(args) == "fsdp2" and settings.keeps_bf16_weights(
        bool(getattr(args, "memory_efficient_bf16", False)),
        settings.step_takes_16_bit_grads(getattr(args, "optimizer", "adam") or "adam",
                                         adam_stats_of(args), getattr(args, "amsgrad", False)))


def step_in_backward_of(args) -> bool:
    """Whether the trainer steps Adam inside backward: --fsdp2-step-in-backward (FSDP2 only)
    where the trainer's rule (settings.step_in_backward_conflict) finds nothing in the way; a
    conflict is the estimate's error, as it is training's (command_line/preflight.py)."""
    if backend_of(args) != "fsdp2" or not getattr(args, "fsdp2_step_in_backward", False):
        return False
    conflict = settings.step_in_backward_conflict(
        getattr(args, "optimizer", "adam") or "adam", adam_stats_of(args),
        bool(getattr(args, "amsgrad", False)), float(getattr(args, "clip_norm", 0) or 0),
        getattr(args, "update_freq", None), precision_of(args) == "fp16",
        bool(getattr(args, "cpu_offload", False)),
        bool(getattr(args, "lora_train_new_rows", False)))
    if conflict is not None:
        raise OptionError(f"--fsdp2-step-in-backward {conflict}")
    return True


def setup_for(args, world_size: int) -> Setup:
    replicate = args.replicate_degree or getattr(args, "fsdp2_replicate_degree", 1) or 1
    device = args.device or ("cpu" if getattr(args, "cpu", False) else "cuda")
    criterion = getattr(args, "criterion", "")
    chunk = getattr(args, "loss_chunk_tokens", 0) if criterion.endswith("_chunked") else 0
    return Setup(
        backend=backend_of(args), world_size=world_size,
        replicate_degree=replicate if backend_of(args) == "fsdp2" else 1,
        precision=precision_of(args), root_reshard=getattr(args, "fsdp2_root_reshard", "default"),
        no_reshard_after_forward=bool(getattr(args, "no_reshard_after_forward", False)),
        reshard_degree=getattr(args, "fsdp2_reshard_degree", 0) or 0,
        optimizer=getattr(args, "optimizer", "adam") or "adam",
        amsgrad=bool(getattr(args, "amsgrad", False)),
        momentum=float(getattr(args, "momentum", 0.0) or 0.0),
        loss_chunk_tokens=int(chunk or 0), device=device, cpu_baseline_gb=args.cpu_baseline_gb,
        cpu_offload=bool(getattr(args, "cpu_offload", False)),
        update_freq=int((getattr(args, "update_freq", None) or [1])[0]),
        no_sync=bool(getattr(args, "fsdp2_no_sync_micro_batches", False)),
        checkpoint_activations=bool(getattr(args, "checkpoint_activations", False)),
        memory_efficient_fp16=bool(getattr(args, "memory_efficient_fp16", False)),
        tied_grad_buffer=tied_grad_buffer_on(args), adam_stats=adam_stats_of(args),
        ema_bytes=ema_bytes_of(args), reduce_dtype=reduce_dtype_of(args),
        narrow_grads=narrow_grads_of(args), bf16_weights=bf16_weights_of(args),
        step_in_backward=step_in_backward_of(args),
        tied_early_reduce=backend_of(args) == "fsdp2" and tied_grad_reduce.applies(
            args, world_size // replicate, int((getattr(args, "update_freq", None) or [1])[0])))


def synthetic_dictionary(size: int) -> Dictionary:
    """fairseq's special symbols and made-up words: ``size`` entries."""
    d = Dictionary()
    for i in range(size - len(d)):
        d.add_symbol(f"w{i}")
    return d


def build_task(args, dictionaries: Optional[dict] = None):
    """The task with its dictionaries: DATA's, or a synthetic one of --vocab-size entries
    (``dictionaries``: size -> the synthetic one, made where missing; the task only reads
    it)."""
    if args.vocab_size:
        from fairseq.tasks.translation import TranslationTask

        dictionaries = {} if dictionaries is None else dictionaries
        if args.vocab_size not in dictionaries:
            dictionaries[args.vocab_size] = synthetic_dictionary(args.vocab_size)
        d = dictionaries[args.vocab_size]
        args.source_lang = args.source_lang or "src"
        args.target_lang = args.target_lang or "tgt"
        return TranslationTask(args, d, d)
    try:
        return tasks.setup_task(args)
    except Exception as e:  # noqa: BLE001 - a missing DATA becomes one line, others propagate
        problem = preflight.data_error(e, getattr(args, "data", None))
        if problem is None:
            raise
        raise OptionError(f"{problem}, or give --vocab-size V instead of DATA") from e


def build_meta_model(args, dictionaries: Optional[dict] = None):
    task = build_task(args, dictionaries)
    with torch.device("meta"):
        return task.build_model(args)


#: the estimator's options that only its setup reads (the ranks, the device, the budget), never
#: a profile (profile_for): a ModelCache's profiles leave them out of their key
NOT_PROFILED = ("world_size", "replicate_degree", "device", "fit_gb", "cpu_baseline_gb")
#: ... and the batch's (workload_for; fairseq's validation batch defaults to it), which no
#: model's construction reads: its models' key
NOT_BUILT_FROM = NOT_PROFILED + ("max_tokens", "batch_size", "seq_len", "max_tokens_valid",
                                 "batch_size_valid")


def _key(args, leave_out: tuple[str, ...]) -> str:
    return repr(sorted((k, v) for k, v in vars(args).items() if k not in leave_out))


class ModelCache:
    """Meta models and their profiles by the arguments they are made from (all but
    NOT_BUILT_FROM, NOT_PROFILED), each made once for the caller that owns the cache: one
    estimate command (its estimates and its --fit-gb search), one run of the doc tables.
    Nothing is kept between a user's runs: the cache lives as long as its owner. A model is
    LoRA-adapted where its arguments ask (profile_for adapts it in place, once). The models
    share one synthetic dictionary of each --vocab-size (NLLB's: 0.15 s to make, 40 MB)."""

    def __init__(self):
        self.models: dict[str, tuple] = {}  # key -> (model, what its build set on args)
        self.profiles: dict[str, ModelProfile] = {}
        self.dictionaries: dict[int, Dictionary] = {}

    def model(self, args):
        """The model of ``args``, which are left as its build leaves them (build_task names a
        synthetic dictionary's languages)."""
        asked = _key(args, NOT_BUILT_FROM)
        if asked not in self.models:
            before = dict(vars(args))
            model = build_meta_model(args, self.dictionaries)
            named = {k: v for k, v in vars(args).items() if k not in before or before[k] != v}
            self.models[asked] = (model, named)
        model, named = self.models[asked]
        vars(args).update(named)
        self.models.setdefault(_key(args, NOT_BUILT_FROM), (model, named))
        return model

    def profile(self, args) -> ModelProfile:
        model = self.model(args)
        key = _key(args, NOT_PROFILED)
        if key not in self.profiles:
            self.profiles[key] = profile_for(args, model)
        return self.profiles[key]


def profile_for(args, model=None) -> ModelProfile:
    model = model if model is not None else build_meta_model(args)
    adapted = lora.adapt(model, args)  # --lora-rank: adapters, the rest frozen (lora.py)
    setup = setup_for(args, 1)
    workload = workload_for(args.max_tokens, args.batch_size, args.seq_len,
                            getattr(args, "required_batch_size_multiple", 8))
    profile = build_profile(
        model, workload, precision=setup.precision,
        min_params_to_wrap=int(getattr(args, "min_params_to_wrap", int(1e8))),
        checkpoint_activations=setup.checkpoint_activations,
        no_reshard_after_forward=setup.no_reshard_after_forward,
        reshard_degree=setup.reshard_degree, root_reshard=setup.root_reshard,
        chunked_loss=setup.loss_chunk_tokens > 0)
    if adapted:
        lora.attach(profile, model)
    return profile


def estimates(args, models: Optional[ModelCache] = None) -> list[Estimate]:
    """The estimate at every world size asked for (``--world-size``, or the run's own);
    ``models``: where the model's profile is taken from (made anew without)."""
    profile = profile_for(args) if models is None else models.profile(args)
    sizes = args.world_size or [max(getattr(args, "distributed_world_size", 1) or 1, 1)]
    return [estimate(profile, setup_for(args, w)) for w in sizes]
