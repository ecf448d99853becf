"""fairseq's hub (``TransformerModel.from_pretrained(...).translate(...)``) with NLLB's task,
``translation_multi_simple_epoch``: two mends, installed by integration/registration.py (patch 10).

1. ``GeneratorHubInterface.generate`` passes ``prefix_allowed_tokens_fn`` to the task's
   ``build_generator``, whose override in ``translation_multi_simple_epoch`` does not take it:
   ``TypeError: build_generator() got an unexpected keyword argument
   'prefix_allowed_tokens_fn'`` on every ``translate``. The override is wrapped to take it; it
   builds its generator without one, so any other value than the hub's default ``None`` is
   refused in one line instead of being ignored.
2. The task starts every hypothesis with the target language tag (its ``inference_step`` forces
   it as the first token) and tells its generator to leave it out of the text
   (``symbols_to_strip_from_output``); ``fairseq-generate`` does so, the hub's ``string`` does
   not, so ``translate`` returned ``__fra_Latn__ ...``. The hub class is replaced by a subclass
   whose ``string`` leaves out the symbols the task's generator names. (The task loads the
   dictionaries of its ``source_lang`` and ``target_lang`` only: one hub per language pair.)
"""
from __future__ import annotations

import functools

import torch
from fairseq.hub_utils import GeneratorHubInterface
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask


def build_generator_taking_prefix_fn(build_generator):
    """``TranslationMultiSimpleEpochTask.build_generator`` that takes the hub's keyword."""
    @functools.wraps(build_generator)
    def wrapped(task, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                prefix_allowed_tokens_fn=None):
        if prefix_allowed_tokens_fn is not None:
            raise ValueError("translation_multi_simple_epoch builds its generator without "
                             "prefix_allowed_tokens_fn (its target language tag is the forced "
                             "prefix); call translate() without it")
        return build_generator(task, models, args, seq_gen_cls=seq_gen_cls,
                               extra_gen_cls_kwargs=extra_gen_cls_kwargs)
    return wrapped


class LanguageTagHub(GeneratorHubInterface):
    """fairseq's hub interface; with ``translation_multi_simple_epoch`` its text leaves out the
    target language tag, as ``fairseq-generate``'s does."""

    def __init__(self, cfg, task, models):
        super().__init__(cfg, task, models)
        self.stripped: set | None = None  # what the task's generator strips, once known

    def string(self, tokens: torch.LongTensor) -> str:
        if not isinstance(self.task, TranslationMultiSimpleEpochTask):
            return super().string(tokens)
        return self.tgt_dict.string(tokens, extra_symbols_to_ignore=self.symbols_to_strip())

    def symbols_to_strip(self) -> set:
        """What the task's generator leaves out of its output (built once to ask: construction
        only, no model call)."""
        if self.stripped is None:
            generator = self.task.build_generator(self.models, self.cfg.generation)
            self.stripped = set(getattr(generator, "symbols_to_strip_from_output", ()))
        return self.stripped
