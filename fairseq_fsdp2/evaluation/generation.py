"""Translation of a test set's directions with NLLB's generation settings, through fairseq's own
code: the configuration ``fairseq-generate`` builds from its command line (``generate_argv``
is that command line), its task, dataset, batch iterator and ``SequenceGenerator``, and its
post-processing, so a direction's translations are the ones stock ``fairseq-generate`` writes
(its ``D-`` lines) with the same settings.

NLLB's settings come from fairseq's NLLB evaluation, ``examples/nllb/modeling/evaluation/
generate_multi.py`` and ``conf/generate_multi.yaml`` (fairseq's nllb branch): it runs
``fairseq-generate`` with ``--beam 4`` (``beam_size: 4``), ``--max-sentences 50`` (dense
models), ``--fp16``, ``--encoder-langtok src --decoder-langtok`` and ``--bpe sentencepiece``;
the length penalty and the maximum length are fairseq-generate's defaults, which it leaves
(``--lenpen 1``, ``--max-len-a 0``, ``--max-len-b 200``). The language-tag settings here are
the model's own (its training task's), the target tag forced as the first token by the task's
``inference_step``, as in training. ``--required-batch-size-multiple 1``: with fairseq's default
(8) its batching silently drops the sentences of a last batch that is not a multiple of 8 (30
sentences at 50 a batch: 24 translated; docs/finetuning_nllb.md), so a test set would be scored
on part of itself.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from .inputs import Direction, TestSet
from .models import NLLB_TASK, ModelSource

#: where the defaults come from (written into the JSON report)
SETTINGS_SOURCE = ("fairseq examples/nllb/modeling/evaluation/generate_multi.py + "
                   "conf/generate_multi.yaml (beam_size 4, --max-sentences 50, fp16); lenpen "
                   "and max length: fairseq-generate's defaults, which it keeps")


@dataclass(frozen=True)
class Generation:
    beam: int = 4
    lenpen: float = 1.0
    max_len_a: float = 0.0
    max_len_b: int = 200
    batch_size: int = 50
    #: "auto": float16 on a GPU (NLLB evaluates with --fp16), float32 on the CPU
    precision: str = "auto"
    device: str = "auto"

    def resolved(self) -> "Generation":
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        precision = self.precision
        if precision == "auto":
            precision = "float16" if device == "cuda" else "float32"
        return Generation(self.beam, self.lenpen, self.max_len_a, self.max_len_b,
                          self.batch_size, precision, device)

    def as_dict(self) -> dict:
        return asdict(self)


def generate_argv(test: TestSet, direction: Direction, model: ModelSource,
                  gen: Generation) -> list[str]:
    """The fairseq-generate command line (after the program name) that translates
    ``direction`` as the evaluation does; precision is applied to the loaded model instead
    (fairseq-generate has --fp16 only)."""
    pairs = list(test.lang_pairs)
    if direction.name not in pairs:
        pairs.append(direction.name)
    argv = [str(test.data), "--path", str(model.path), "--task", NLLB_TASK,
            "--langs", ",".join(test.langs), "--lang-pairs", ",".join(pairs),
            "--source-lang", direction.src, "--target-lang", direction.tgt,
            "--lang-tok-style", model.lang_tok_style, "--gen-subset", test.split,
            "--beam", str(gen.beam), "--lenpen", str(gen.lenpen),
            "--max-len-a", str(gen.max_len_a), "--max-len-b", str(gen.max_len_b),
            "--batch-size", str(gen.batch_size), "--required-batch-size-multiple", "1",
            "--bpe", "sentencepiece",
            "--sentencepiece-model", str(test.spm_model), "--num-workers", "0"]
    if model.encoder_langtok:
        argv += ["--encoder-langtok", model.encoder_langtok]
    if model.decoder_langtok:
        argv.append("--decoder-langtok")
    if gen.device == "cpu":
        argv.append("--cpu")
    return argv


def fairseq_config(argv: list[str]):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    parser = options.get_generation_parser()
    return convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, argv))


#: the options of generate_argv that name the direction; NLLB's task is configured by argparse,
#: so fairseq's configuration holds them in the task's namespace only (cfg.task)
DIRECTION_OPTIONS = ("source_lang", "target_lang", "lang_pairs")


class DirectionConfigs:
    """``fairseq_config(argv)`` for direction after direction of one test set and model:
    fairseq's conversion (hydra composing its configuration from every option, 0.2-0.3 CPU-s)
    made once, then for each further direction a copy with the task's direction options as
    fairseq's parser reads them from that direction's command line. Where the command line
    differs in anything else, or the task is not configured by argparse, it converts again.
    Each configuration returned is its own (the task's namespace too, which a deep copy of
    fairseq's configuration would share): a task that changes its own leaves the others."""

    def __init__(self):
        self.first = None

    def __call__(self, argv: list[str]):
        from argparse import Namespace

        from fairseq import options
        if self.first is None or not isinstance(self.first.task, Namespace):
            self.first = fairseq_config(argv)
            return self.copy(vars(self.first.task) if isinstance(self.first.task, Namespace)
                             else None)
        parsed = vars(options.parse_args_and_arch(options.get_generation_parser(), argv))
        missing = object()
        if any(getattr(self.first.task, k, missing) != v for k, v in parsed.items()
               if k not in DIRECTION_OPTIONS):
            return fairseq_config(argv)
        return self.copy({**vars(self.first.task),
                          **{name: parsed[name] for name in DIRECTION_OPTIONS}})

    def copy(self, task: Optional[dict]):
        """The first configuration, copied, with a namespace of ``task`` as its task."""
        import copy
        from argparse import Namespace

        from fairseq.dataclass.utils import omegaconf_no_object_check
        cfg = copy.deepcopy(self.first)
        if task is not None:
            with omegaconf_no_object_check():  # fairseq's own way to hold a namespace there
                cfg.task = Namespace(**task)
        return cfg


@dataclass
class Translations:
    hypotheses: list[str]
    references: list[str]
    sources: Optional[list[str]] = None


class FairseqTranslator:
    """One fairseq checkpoint, loaded once, translating direction after direction."""

    def __init__(self, model: ModelSource, test: TestSet, gen: Generation):
        self.model, self.test, self.gen = model, test, gen.resolved()
        self.models = None
        self.saved_task_cfg = None
        self.configs = DirectionConfigs()

    def _load(self, task, cfg) -> None:
        from fairseq import checkpoint_utils
        if self.model.kind == "hf":
            from .hf_model import build
            models, saved_task = [build(self.model.path, task, str(self.test.data))], None
        else:
            models, saved = checkpoint_utils.load_model_ensemble([str(self.model.path)],
                                                                 task=task)
            saved_task = saved.task
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(self.gen.precision)
        for m in models:
            if dtype is not None:
                m.to(dtype)
            if self.gen.device != "cpu":
                m.to(self.gen.device)
            m.prepare_for_inference_(cfg)
        self.models, self.saved_task_cfg = models, saved_task

    def translate(self, direction: Direction,
                  progress: Callable = lambda it, **kw: it) -> Translations:
        from fairseq import tasks, utils
        cfg = self.configs(generate_argv(self.test, direction, self.model, self.gen))
        task = tasks.setup_task(cfg.task)
        if self.models is None:
            self._load(task, cfg)
        models = self.models
        tgt_dict = task.target_dictionary
        bpe = task.build_bpe(cfg.bpe)
        sources = None
        if self.test.raw is None:
            task.load_dataset(cfg.dataset.gen_subset, task_cfg=self.saved_task_cfg)
            dataset = task.dataset(cfg.dataset.gen_subset)
        else:
            sources = self.test.raw_lines(direction, direction.src)
            tokens = [task.source_dictionary.encode_line(bpe.encode(s), add_if_not_exist=False,
                                                         append_eos=True).long()
                      for s in sources]
            dataset = task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
        itr = task.get_batch_iterator(
            dataset=dataset, max_tokens=cfg.dataset.max_tokens,
            max_sentences=cfg.dataset.batch_size,
            max_positions=utils.resolve_max_positions(task.max_positions(),
                                                      *[m.max_positions() for m in models]),
            ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
            required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
            seed=cfg.common.seed, num_shards=1, shard_id=0, num_workers=0,
            data_buffer_size=cfg.dataset.data_buffer_size).next_epoch_itr(shuffle=False)
        generator = task.build_generator(models, cfg.generation, extra_gen_cls_kwargs={
            "lm_model": None, "lm_weight": cfg.generation.lm_weight})
        strip = getattr(generator, "symbols_to_strip_from_output", None) or {generator.eos}
        post = cfg.common_eval.post_process
        hyps: dict[int, str] = {}
        refs: dict[int, str] = {}
        for sample in progress(itr, total=len(itr)):
            if self.gen.device != "cpu":
                sample = utils.move_to_cuda(sample)
            if "net_input" not in sample:
                continue
            with torch.no_grad():
                hypos = task.inference_step(generator, models, sample)
            for i, sample_id in enumerate(sample["id"].tolist()):
                _, text, _ = utils.post_process_prediction(
                    hypo_tokens=hypos[i][0]["tokens"].int().cpu(), src_str="",
                    alignment=hypos[i][0]["alignment"], align_dict=None, tgt_dict=tgt_dict,
                    remove_bpe=post, extra_symbols_to_ignore=strip)
                hyps[sample_id] = bpe.decode(text)
                if sample.get("target") is not None:
                    target = utils.strip_pad(sample["target"][i, :], tgt_dict.pad()).int().cpu()
                    refs[sample_id] = bpe.decode(tgt_dict.string(
                        target, post, escape_unk=True, extra_symbols_to_ignore=strip))
        n = len(dataset)
        if sorted(hyps) != list(range(n)):
            raise RuntimeError(f"{direction.name}: {n - len(hyps)} of {n} sentences were not "
                               f"translated: fairseq's batch iterator left them out")
        references = (self.test.raw_lines(direction, direction.tgt) if self.test.raw is not None
                      else [refs[i] for i in range(n)])
        return Translations([hyps[i] for i in range(n)], references, sources)


def progress_bar(label: str):
    """A per-direction progress bar on stderr (tqdm, shown on a terminal only)."""
    def bar(iterable, total=None):
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc=label, unit="batch", file=sys.stderr,
                    disable=None, leave=False)
    return bar
