"""The warnings a run and fairseq's hydra calls raise while all is well, silenced exactly.

Each entry is one warning (message regex, category, module regex) with the reason it says nothing
to the user. The plugin is a guest in the user's process (``fairseq-train``, or a program that
trains in-process), so nothing here is installed at import: the run's lifecycle applies
``RUN_WARNINGS`` for the duration of a run (``install``/``remove``, or ``silenced``), and fairseq's
hydra calls are wrapped one call at a time (``hydra_calls_silenced``, integration/registration.py).
Every other warning, and these same ones outside a run, still reach the user.

The FSDP2 view-tensor warning (torch's ``_fully_shard/_fsdp_state.py``, raised when a unit's
forward output that requires grad is a view): with fairseq's transformer the views are
- ``TransformerDecoderLayerBase``: output[1], the head-wise cross-attention probabilities of the
  last layer (fairseq's decoder asks the ``alignment_layer`` for them: a ``transpose`` of
  ``attn_weights_float.view(...)`` in ``MultiheadAttention``);
- ``TransformerModel`` (the root): ``extra["inner_states"][0]``, the decoder input after
  ``x.transpose(0, 1)``, and with ``features_only=True`` (the chunked loss) output[0], the
  features after ``x.transpose(0, 1)``;
- a ``FairseqMultiModel`` root (``MultilingualTransformerModel``, latent depth's
  ``LatentMultilingualTransformerModel``): a task's call of a sub-model runs in the root's hooks
  (sharding/units.py, ``route_direct_calls``) and returns that sub-model's output, the
  transformer's tensors above;
- the shared-embedding unit (``TiedGradLinear, TiedGradEmbedding``, or ``Linear, Embedding``
  without the tied-gradient buffer) in the chunked loss: the same tensors as the root.
The warning is about an in-place op on such a view, which would rebase it and drop the hook
FSDP2 put on it. No code path we support does one: the decoder reads the attention probabilities
with ``.float().to(x)`` (no-ops) and ``attn.mean(dim=0)``, the alignment criterion with ``.view``
and indexing; ``inner_states`` is read by no translation criterion; the chunked loss slices and
indexes the features (``fused_sums``); the trainer's in-place op on a result, ``loss *= 0`` on
dummy batches, is on the criterion's loss, not on a unit's output. Returning non-views instead
would copy each of these tensors (the last layer's heads x tokens x source probabilities among
them) in every step. The tests that compare FSDP2's losses and gradients with stock fairseq's
(tests/test_backend.py and others) would fail if an all-gather were skipped.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Quiet:
    message: str  # regex, matched at the start of the message (warnings' rule)
    category: type
    module: str  # regex, matched against the module the warning is attributed to
    reason: str


_FSDP2_UNITS_WITH_VIEWS = ("FSDPTransformerDecoderLayerBase", "FSDPTransformerModel",
                           "FSDPMultilingualTransformerModel",
                           "FSDPLatentMultilingualTransformerModel",
                           "FSDPTiedGradLinear, FSDPTiedGradEmbedding",
                           "FSDPLinear, FSDPEmbedding")

#: Applied for the duration of an FSDP2 run (the run's lifecycle: install at its start, remove
#: at its end).
RUN_WARNINGS = (
    Quiet(r"FSDP2-wrapped module \((?:" + "|".join(_FSDP2_UNITS_WITH_VIEWS)
          + r")\) returned a view tensor", UserWarning,
          r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state\Z",
          "fairseq's transformer units return views on which no supported code path does an "
          "in-place op (see the module docstring)"),
    Quiet(r"Distributed is already initialized", UserWarning, r"fairseq\.distributed\.utils\Z",
          "the plugin starts the process group itself (torchrun, heartbeat timeout) before "
          "fairseq's distributed_init, which then finds it: expected"),
    Quiet(r"'pin_memory' argument is set as true but no accelerator is found", UserWarning,
          r"torch\.utils\.data\.dataloader\Z",
          "fairseq's batch iterator always asks for pinned memory; on CPU ranks there is none "
          "to use and torch ignores the request"),
    Quiet(r"`torch\.cuda\.amp\.autocast\(args\.\.\.\)` is deprecated", FutureWarning,
          r"fairseq\.tasks\.fairseq_task\Z",
          "fairseq 0.12's train_step spells torch's autocast the old way; it works as before "
          "and is off unless --amp"),
    Quiet(r"Support for mismatched key_padding_mask and attn_mask is deprecated", UserWarning,
          r"torch\.nn\.functional\Z",
          "fairseq's attention passes a bool padding mask with a float causal mask; torch "
          "converts one to the other as it always has (stock fairseq runs warn alike)"),
)

#: fairseq's hydra calls: fairseq.dataclass.utils builds every command's config with
#: hydra.experimental's initialize/compose (strict=False) from config files written for Hydra
#: 1.0 (`# @package _group_`, a schema stored under the config's own name), and fairseq_cli's
#: hydra main has no version_base. Hydra 1.3 says so at each call; nothing the user can change.
HYDRA_DEPRECATIONS = tuple(
    Quiet(message, UserWarning, r"", "fairseq's use of Hydra 1.0 APIs and config layout")
    for message in (r"hydra\.experimental\.initialize\(\) is no longer experimental",
                    r"hydra\.experimental\.compose\(\) is no longer experimental",
                    r"\s*The version_base parameter is not specified",
                    r"In '[^']*': Usage of deprecated keyword in package header",
                    r"\s*'[^']*' is validated against ConfigStore schema with the same name",
                    r"\s*The strict flag in the compose API is deprecated",
                    r"\s*Future Hydra versions will no longer change working directory"))


def _filter_item(quiet: Quiet) -> tuple:
    """The entry ``warnings.filterwarnings`` makes for ``quiet`` (compiled as it compiles)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=quiet.message, category=quiet.category,
                                module=quiet.module)
        return warnings.filters[0]


def install(quiets=RUN_WARNINGS) -> list[tuple]:
    """Add an ``ignore`` filter for each of ``quiets`` in front of the process's filters; returns
    what ``remove`` takes. Entries already present (the user's own) are left alone and are not
    removed later."""
    added = []
    for quiet in quiets:
        item = _filter_item(quiet)
        if item not in warnings.filters:
            warnings.filterwarnings("ignore", message=quiet.message, category=quiet.category,
                                    module=quiet.module)
            added.append(item)
    return added


def remove(added: list[tuple]) -> None:
    """Take out exactly the filters ``install`` added; the rest of the list is untouched."""
    for item in added:
        with contextlib.suppress(ValueError):  # the user reset the filters meanwhile
            warnings.filters.remove(item)
    # No cache to clear: an ignored warning is never recorded in a module's registry, so the
    # next one is matched against the filters again and reaches the user.


@contextlib.contextmanager
def silenced(quiets=RUN_WARNINGS) -> Iterator[None]:
    """``install`` on entry, ``remove`` on exit."""
    added = install(quiets)
    try:
        yield
    finally:
        remove(added)


def hydra_calls_silenced(function):
    """``function`` (one of fairseq's hydra calls) with hydra's deprecation notices silenced
    during the call only."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        with silenced(HYDRA_DEPRECATIONS):
            return function(*args, **kwargs)
    return call


def hydra_initialize_silenced(initialize):
    """As ``hydra_calls_silenced``, for hydra's ``initialize``: it finds ``config_path``
    relative to the file of the frame ``caller_stack_depth`` up (its public parameter), one
    frame further up through this wrapper."""
    @functools.wraps(initialize)
    def call(*args, caller_stack_depth: int = 1, **kwargs):
        with silenced(HYDRA_DEPRECATIONS):
            return initialize(*args, caller_stack_depth=caller_stack_depth + 1, **kwargs)
    return call


def no_debug_log() -> None:
    """For the plugin's own commands (``python -m fairseq_fsdp2.X``), which own their process:
    importing fairseq runs ``logging.basicConfig(level=logging.DEBUG)``
    (fairseq/models/wav2vec/wav2vec2_classification.py), so every library's debug lines
    (matplotlib's, hydra's) reach stderr. Back to INFO, fairseq-train's level."""
    if logging.root.level < logging.INFO:
        logging.root.setLevel(logging.INFO)
