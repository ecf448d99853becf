"""The plugin's options: one dataclass, validated in one place.

The options live in fairseq's ``distributed_training`` group (a subclass of fairseq's
``DistributedTrainingConfig``), so they are kebab-case flags on the command line
(``--fsdp2-root-reshard always``) and the same keys in hydra
(``distributed_training.fsdp2_root_reshard=always``). ``integration/registration.py`` installs
the class.
"""

import re
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass.configs import DistributedTrainingConfig
from fairseq.dataclass.constants import DDP_BACKEND_CHOICES, ChoiceEnum

from .errors import OptionError

#: Backends this plugin serves. ``fully_sharded`` is fairseq's legacy (fairscale) FSDP; with the
#: plugin loaded it runs on FSDP2 so that legacy command lines keep working.
FSDP2_BACKEND = "fsdp2"
LEGACY_FSDP_BACKEND = "fully_sharded"
SERVED_BACKENDS = (FSDP2_BACKEND, LEGACY_FSDP_BACKEND)

DDP_BACKEND_WITH_FSDP2 = ChoiceEnum([c.value for c in DDP_BACKEND_CHOICES] + [FSDP2_BACKEND])
ROOT_RESHARD_CHOICES = ChoiceEnum(["default", "always"])
REDUCE_DTYPE_CHOICES = ChoiceEnum(["fp32", "fp16", "bf16"])
#: --lora-modules' default: PEFT's names for NLLB's (M2M100's) attention and feed-forward
LORA_MODULE_NAMES = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
DEFAULT_LORA_MODULES = ",".join(LORA_MODULE_NAMES)


@dataclass
class FSDP2DistributedTrainingConfig(DistributedTrainingConfig):
    """fairseq's distributed options plus the FSDP2 backend's own."""

    # Redeclared only to admit the new value; fairseq validates it against this type.
    ddp_backend: DDP_BACKEND_WITH_FSDP2 = field(
        default="pytorch_ddp",
        metadata={"help": "DistributedDataParallel backend (fsdp2: PyTorch fully_shard, "
                          "from the fairseq_fsdp2 plugin)"},
    )
    fsdp2_root_reshard: ROOT_RESHARD_CHOICES = field(
        default="default",
        metadata={"help": "FSDP2: what the root unit and the shared-embedding unit do after "
                          "forward. 'default': keep their parameters gathered until backward "
                          "(PyTorch's choice for the root; no re-gather, more memory). "
                          "'always': reshard them and gather again in backward (less memory, "
                          "one more all-gather per step)"},
    )
    fsdp2_reshard_degree: int = field(
        default=0,
        metadata={"help": "FSDP2: after forward, reshard the per-layer units to groups of this "
                          "many ranks instead of the whole shard group (a divisor of it other "
                          "than 1 and itself, e.g. the GPUs per node); 0: follow "
                          "--no-reshard-after-forward"},
    )
    fsdp2_replicate_degree: int = field(
        default=1,
        metadata={"help": "FSDP2: HSDP replicas. R > 1 builds an R x (world/R) mesh: "
                          "parameters are sharded within each group of world/R ranks and "
                          "replicated across the R groups (e.g. R = number of nodes)"},
    )
    fsdp2_no_sync_micro_batches: bool = field(
        default=False,
        metadata={"help": "FSDP2: with --update-freq > 1, skip the gradient reduce-scatter on "
                          "all but the last micro-batch (less communication, but unsharded "
                          "gradients are kept between micro-batches)"},
    )
    fsdp2_reduce_dtype: REDUCE_DTYPE_CHOICES = field(
        default="fp32",
        metadata={"help": "FSDP2: the dtype gradients are reduce-scattered in. fp32 (the "
                          "default): the 16-bit gradients are copied to fp32 first; fp16 with "
                          "--fp16, bf16 with --bf16: reduced in the compute dtype, as stock "
                          "fairseq's --fp16 all-reduces them (half the reduce-scatter buffer "
                          "and traffic; the sum rounded to 16 bits)"},
    )
    fsdp2_no_consolidate: bool = field(
        default=False,
        metadata={"help": "FSDP2: do not write checkpoint_best/last_consolidated.pt (stock "
                          "fairseq format, read by fairseq-generate) at the end of training"},
    )
    fsdp2_memory_breakdown: int = field(
        default=0,
        metadata={"help": "FSDP2: record update N's memory on every rank by category (sharded "
                          "and gathered params, gradients, optimizer state, activations, "
                          "logits/loss, comm buffers, other) and the top modules; rank 0 logs "
                          "one table (a column per rank) and writes "
                          "<save-dir>/memory_breakdown.json. Costs time on that update only; "
                          "0: off"},
    )
    fsdp2_no_tied_grad_buffer: bool = field(
        default=False,
        metadata={"help": "FSDP2: give each use of a tied embedding (encoder input, decoder "
                          "input, output projection) its own vocab x dim gradient, as stock "
                          "autograd does, instead of accumulating them in one buffer (the "
                          "default: up to 2 x vocab x dim less memory per rank in backward; "
                          "the same gradient up to float rounding)"},
    )
    fsdp2_no_tied_early_reduce: bool = field(
        default=False,
        metadata={"help": "FSDP2, with the tied-gradient buffer: let FSDP2 reduce-scatter the "
                          "tied embedding's whole vocab x dim gradient at the end of backward, "
                          "instead of reducing the output projection's part into this rank's "
                          "gradient shard as soon as backward starts and exchanging only the "
                          "looked-up rows at its end (the default where it applies: no "
                          "vocab x dim gradient alive through backward; the same gradient up "
                          "to float rounding)"},
    )
    bf16_adam_stats: bool = field(
        default=False,
        metadata={"help": "FSDP2, --optimizer adam: keep Adam's two moments in bf16 between "
                          "steps (stochastic rounding), as --fp16-adam-stats keeps them in "
                          "fp16: half the optimizer state's memory; meant for --bf16 runs"},
    )
    eight_bit_adam_stats: bool = field(
        default=False,
        metadata={"help": "FSDP2, --optimizer adam: keep Adam's two moments in 8 bits between "
                          "steps, block-wise quantized per shard as bitsandbytes' and torchao's "
                          "8-bit Adam (blocks of 256 within rows, stochastic rounding; "
                          "parameters under 4096 elements or 1-D keep float32): about a "
                          "quarter of the optimizer state's memory"},
    )
    fsdp2_tied_grad_buffer: bool = field(
        default=False,
        metadata={"help": "FSDP2: accepted for older command lines; the tied-gradient buffer "
                          "is now on unless --fsdp2-no-tied-grad-buffer"},
    )
    init_new_langs_from: Optional[str] = field(
        default=None,
        metadata={"help": "FSDP2, --finetune-from-model into a dictionary with more entries "
                          "than the model's embedding rows (new languages or pieces added by "
                          "scripts/prepare_data.sh --add-langs/--add-pieces): the rows of the new "
                          "language codes start as a copy of this language's row (e.g. "
                          "eng_Latn), or, per language, NEW=FROM,... (xxx_Latn=fra_Latn,"
                          "yyy_Cyrl=rus_Cyrl). Every other new row starts as the mean of the "
                          "pretrained rows; the pretrained rows are kept as they are"},
    )
    fsdp2_fp32_grad_shards: bool = field(
        default=False,
        metadata={"help": "FSDP2, --fsdp2-reduce-dtype fp16/bf16: cast each reduce-scattered "
                          "gradient shard to fp32 (FSDP2's default) instead of keeping it in the "
                          "reduce dtype for the optimizer (the default where the step takes "
                          "16-bit gradients: Adam with float32, bf16 or 8-bit moments, "
                          "--update-freq 1, no --cpu-offload; the same update bit for bit, 2 "
                          "bytes per parameter element more)"},
    )
    fsdp2_step_in_backward: bool = field(
        default=False,
        metadata={"help": "FSDP2, --optimizer adam: step each parameter as soon as FSDP2 has "
                          "reduce-scattered its gradient, inside backward, and free that "
                          "gradient, so that no whole-model gradient is held (about one "
                          "layer's at a time); the same update as fairseq's step bit for bit. "
                          "Needs --clip-norm 0 and --update-freq 1, no --fp16 (bf16 or fp32), "
                          "no --fp16-adam-stats; costs one small all-reduce of the batch's "
                          "sample size before backward"},
    )

    # -- LoRA (docs/lora.md): a group of its own, at the end -----------------------------------
    lora_rank: int = field(
        default=0,
        metadata={"help": "FSDP2: fine-tune with low-rank adapters (LoRA) of this rank; 0 (the "
                          "default): off. The base weights are frozen and kept in the compute "
                          "dtype (16 bits with --fp16/--bf16), with no gradient and no "
                          "optimizer state; only the adapters (and --lora-train-params) train"},
    )
    lora_alpha: Optional[float] = field(
        default=None,
        metadata={"help": "FSDP2, --lora-rank: the adapters' scaling is alpha / rank, as in "
                          "PEFT; default: the rank (scaling 1)"},
    )
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "FSDP2, --lora-rank: dropout on the adapters' input (PEFT's "
                          "lora_dropout)"},
    )
    lora_modules: str = field(
        default=DEFAULT_LORA_MODULES,
        metadata={"help": "FSDP2, --lora-rank: the linear modules given adapters, by name "
                          "(PEFT's target_modules): a comma-separated list of module names or "
                          "dotted path ends, e.g. q_proj,v_proj or encoder_attn.q_proj; "
                          "default: the attention q/k/v/out projections and fc1/fc2 of every "
                          "encoder and decoder layer"},
    )
    lora_train_params: Optional[str] = field(
        default=None,
        metadata={"help": "FSDP2, --lora-rank: parameters kept trainable in full beside the "
                          "adapters (fp32, with optimizer state): comma-separated regular "
                          "expressions searched in parameter names, e.g. layer_norm or "
                          "embed_tokens (the shared embedding, for languages added with "
                          "--init-new-langs-from)"},
    )
    lora_train_new_rows: bool = field(
        default=False,
        metadata={"help": "FSDP2, --lora-rank: train the shared embedding's rows that the "
                          "dictionary adds to the pretrained model's (new languages and pieces, "
                          "--init-new-langs-from) beside the adapters; the pretrained rows keep "
                          "their values bit for bit (their gradient is zeroed before the "
                          "optimizer step; the embedding then has fp32 weights and optimizer "
                          "state). Not with --weight-decay, which would move them"},
    )


#: the plugin's own keys of the distributed_training group (stock fairseq has none of them)
PLUGIN_OPTIONS = frozenset(FSDP2DistributedTrainingConfig.__dataclass_fields__) - frozenset(
    DistributedTrainingConfig.__dataclass_fields__)

# models/nllb_languages.py's LANG_CODE (options are below models in the layers)
_LANG_CODE = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")
#: the key of new_lang_sources for "every new language"
EVERY_NEW_LANG = "*"


def new_lang_sources(spec: Optional[str]) -> dict[str, str]:
    """--init-new-langs-from as {new language or EVERY_NEW_LANG: language whose row it copies};
    OptionError if malformed."""
    sources: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (spec or "").split(","))):
        new, _, source = item.rpartition("=")
        new = new or EVERY_NEW_LANG
        for code in (new, source):
            if code != EVERY_NEW_LANG and not _LANG_CODE.match(code):
                raise OptionError(f"--init-new-langs-from: {code!r} is not a language code like "
                                  f"eng_Latn (expected LANG, or NEW=LANG,...)")
        if new in sources or (new == EVERY_NEW_LANG and sources) or \
                EVERY_NEW_LANG in sources:
            raise OptionError(f"--init-new-langs-from {spec}: name one language for all new "
                              f"ones, or NEW=LANG once per new language")
        sources[new] = source
    return sources


def tied_grad_buffer_on(dt) -> bool:
    """Whether the tied embedding's gradient goes into one buffer (the default)."""
    return not getattr(dt, "fsdp2_no_tied_grad_buffer", False)


def validate(dt: FSDP2DistributedTrainingConfig, *, min_params_to_wrap: int, fp16: bool,
             bf16: bool, world_size: int, optimizer: str = "adam",
             fp16_adam_stats: bool = False) -> None:
    """Check the plugin's options against each other and the world size.

    Raises OptionError with one line naming the option; called before any work is done.
    """
    if min_params_to_wrap is not None and min_params_to_wrap < 0:
        raise OptionError(f"--min-params-to-wrap must be >= 0, got {min_params_to_wrap}")
    if fp16 and bf16:
        raise OptionError("--fp16 and --bf16 are mutually exclusive: choose one")
    replicate = dt.fsdp2_replicate_degree
    if replicate < 1:
        raise OptionError(f"--fsdp2-replicate-degree must be >= 1, got {replicate}")
    if world_size % replicate != 0:
        raise OptionError(f"--fsdp2-replicate-degree {replicate} does not divide the world "
                          f"size {world_size}")
    shard_size = world_size // replicate
    degree = dt.fsdp2_reshard_degree
    if degree < 0:
        raise OptionError(f"--fsdp2-reshard-degree must be >= 0, got {degree}")
    if degree > 0 and dt.no_reshard_after_forward:
        raise OptionError("--fsdp2-reshard-degree and --no-reshard-after-forward conflict: "
                          "choose one")
    if degree > 0 and (shard_size % degree != 0 or degree in (1, shard_size)):
        # FSDP2 takes only a non-trivial divisor: 1 would be --no-reshard-after-forward and
        # the shard group size is the default.
        raise OptionError(f"--fsdp2-reshard-degree {degree} must divide the shard group size "
                          f"{shard_size} (world size {world_size} / replicate degree "
                          f"{replicate}) and be neither 1 nor {shard_size}")
    if dt.fsdp2_tied_grad_buffer and dt.fsdp2_no_tied_grad_buffer:
        raise OptionError("--fsdp2-tied-grad-buffer and --fsdp2-no-tied-grad-buffer conflict: "
                          "choose one")
    if dt.bf16_adam_stats and fp16_adam_stats:
        raise OptionError("--bf16-adam-stats and --fp16-adam-stats conflict: choose one")
    eight_bit = getattr(dt, "eight_bit_adam_stats", False)
    for other, given in (("--fp16-adam-stats", fp16_adam_stats),
                         ("--bf16-adam-stats", dt.bf16_adam_stats)):
        if eight_bit and given:
            raise OptionError(f"--eight-bit-adam-stats and {other} conflict: choose one")
    for flag, given in (("--bf16-adam-stats", dt.bf16_adam_stats),
                        ("--eight-bit-adam-stats", eight_bit)):
        if given and optimizer != "adam":
            raise OptionError(f"{flag} keeps Adam's moments: it needs --optimizer adam, "
                              f"got --optimizer {optimizer}")
    check_reduce_dtype(str(getattr(dt, "fsdp2_reduce_dtype", "fp32")), fp16=fp16, bf16=bf16)
    new_lang_sources(getattr(dt, "init_new_langs_from", None))
    check_lora(dt)
    breakdown = dt.fsdp2_memory_breakdown
    if breakdown < 0:
        raise OptionError(f"--fsdp2-memory-breakdown must be >= 0 (an update number; 0: off), "
                          f"got {breakdown}")


#: what each 16-bit --fsdp2-reduce-dtype needs: the matching compute dtype
REDUCE_DTYPE_NEEDS = {"fp16": "--fp16 (or --memory-efficient-fp16)", "bf16": "--bf16"}


def check_reduce_dtype(reduce_dtype: str, *, fp16: bool, bf16: bool) -> None:
    """--fsdp2-reduce-dtype is fp32 or the compute dtype. fp16 needs --fp16: only fairseq's loss
    scaling keeps fp16 gradients in range (a bf16 or fp32 run has none). bf16 needs --bf16:
    with --fp16 it would round the fp16 gradients to bf16's 8 bits for no memory saved, and
    fp32 gradients are not 16 bits to begin with (FSDP2 would keep them full size in fp32)."""
    compute = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    if reduce_dtype != "fp32" and reduce_dtype != compute:
        raise OptionError(f"--fsdp2-reduce-dtype {reduce_dtype} needs "
                          f"{REDUCE_DTYPE_NEEDS[reduce_dtype]}: gradients are reduced in fp32 "
                          f"or in the compute dtype, here {compute}")


_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


def lora_modules(dt) -> list[str]:
    """--lora-modules as a list of names (dotted path ends)."""
    return [n.strip() for n in str(getattr(dt, "lora_modules", DEFAULT_LORA_MODULES)
                                   or "").split(",") if n.strip()]


def lora_train_patterns(dt) -> list[str]:
    """--lora-train-params as a list of regular expressions."""
    return [p.strip() for p in str(getattr(dt, "lora_train_params", None) or "").split(",")
            if p.strip()]


def lora_scaling(dt) -> float:
    """alpha / rank (alpha defaults to the rank)."""
    rank = int(getattr(dt, "lora_rank", 0) or 0)
    alpha = getattr(dt, "lora_alpha", None)
    return (rank if alpha is None else float(alpha)) / rank


def check_lora(dt) -> None:
    """The LoRA options against each other (OptionError, one line)."""
    rank = int(getattr(dt, "lora_rank", 0) or 0)
    if rank < 0:
        raise OptionError(f"--lora-rank must be >= 0 (0: off), got {rank}")
    given = [flag for flag, on in (
        ("--lora-alpha", getattr(dt, "lora_alpha", None) is not None),
        ("--lora-dropout", float(getattr(dt, "lora_dropout", 0.0) or 0.0) != 0.0),
        ("--lora-modules", str(getattr(dt, "lora_modules", DEFAULT_LORA_MODULES))
         != DEFAULT_LORA_MODULES),
        ("--lora-train-params", bool(getattr(dt, "lora_train_params", None))),
        ("--lora-train-new-rows", bool(getattr(dt, "lora_train_new_rows", False)))) if on]
    if rank == 0:
        if given:
            raise OptionError(f"{given[0]} needs --lora-rank R > 0 (LoRA is off)")
        return
    alpha = getattr(dt, "lora_alpha", None)
    if alpha is not None and not float(alpha) > 0:
        raise OptionError(f"--lora-alpha must be > 0, got {alpha:g}")
    dropout = float(getattr(dt, "lora_dropout", 0.0) or 0.0)
    if not 0.0 <= dropout < 1.0:
        raise OptionError(f"--lora-dropout must be >= 0 and < 1, got {dropout:g}")
    names = lora_modules(dt)
    bad = [n for n in names if not _MODULE_NAME.match(n)]
    if not names or bad:
        raise OptionError(f"--lora-modules: {bad[0] if bad else dt.lora_modules!r} is not a "
                          f"module name (expected names like {DEFAULT_LORA_MODULES})")
    for pattern in lora_train_patterns(dt):
        try:
            re.compile(pattern)
        except re.error as e:
            raise OptionError(f"--lora-train-params: {pattern!r} is not a regular expression "
                              f"({e})") from None
