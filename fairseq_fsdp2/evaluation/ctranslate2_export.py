"""Export to CTranslate2 (``consolidate CHECKPOINT OUT --format ctranslate2``) and translation
with the exported directory (an evaluation model).

The model is built by fairseq from the checkpoint exactly as generation builds it (its full
weights: a sharded checkpoint read from its shards, a LoRA checkpoint's adapters merged;
generation.py), then copied into CTranslate2's Transformer specification by CTranslate2's own
fairseq converter functions (``ctranslate2.converters.fairseq``: the layer-by-layer copy, the
fused attention projections, the sinusoidal table). Only the loading is ours: CTranslate2's
``FairseqConverter`` reads the legacy ``args`` of a checkpoint and builds the task from them,
which an NLLB checkpoint (hydra config, ``translation_multi_simple_epoch``, a sharded file) does
not fit. No transformers at run time.

How NLLB's fairseq model reads and writes, and so how the directory translates (its
``nllb.json`` and README.md say it too): source tokens ``__SRC__ pieces... </s>`` (the source
tag first, with --encoder-langtok src; ``add_source_eos`` appends ``</s>``), the decoder starts
with ``</s>`` and the target tag is the forced first token: ``target_prefix=[["__TGT__"]]``;
the output's first token is that tag.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from ..checkpoint.export import plain_config
from ..errors import CheckpointError
from .generation import Generation, Translations, fairseq_config, generate_argv
from .inputs import Direction, TestSet, listed, pair_file
from .models import CT2_CONFIG as CONFIG, CT2_SPM as SPM_FILE, ModelSource, \
    ct2_vocabulary, fairseq_checkpoint, need_ctranslate2, saved_task, trained_data_dir

QUANTIZATIONS = ("int8", "int8_float16", "int8_float32", "float16", "bfloat16", "float32")


def _data_set(data: Path) -> TestSet:
    langs, pairs = listed(data / "langs.txt"), listed(data / "lang_pairs.txt")
    return TestSet(data, "test", (), langs, pairs)


def load_fairseq(checkpoint: str, data: Path):
    """The fairseq model of ``checkpoint`` (float32, CPU, eval mode), its task and saved model
    config, built as generation builds it."""
    from fairseq import checkpoint_utils, tasks
    test = _data_set(data)
    source = fairseq_checkpoint(Path(checkpoint), "model", test.dictionary)
    src, _, tgt = test.lang_pairs[0].partition("-")
    argv = generate_argv(test, Direction(src, tgt), source, Generation(device="cpu"))
    task = tasks.setup_task(fairseq_config(argv).task)
    models, saved = checkpoint_utils.load_model_ensemble([checkpoint], task=task)
    model = models[0].float().eval().requires_grad_(False)
    return model, task, saved, source


def spec_of(model, task, saved):
    """CTranslate2's TransformerSpec holding ``model``'s weights."""
    from ctranslate2.converters import fairseq as ct2_fairseq
    args = plain_config(saved.model)  # a Namespace for the legacy architectures, else a
    # DictConfig
    args = argparse.Namespace(**{**args, "arch": args.get("arch") or args.get("_name")})
    try:
        spec = ct2_fairseq._get_model_spec(args)  # noqa: SLF001 - the converter's own check
    except ValueError as e:
        raise CheckpointError(f"CTranslate2 cannot hold this model: {e}") from None
    ct2_fairseq.set_transformer_encoder(spec.encoder, model.encoder)
    ct2_fairseq.set_transformer_decoder(spec.decoder, model.decoder)
    vocab = ct2_vocabulary(task.source_dictionary.symbols)
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    spec.config.decoder_start_token = spec.config.eos_token  # fairseq's decoder starts with </s>
    spec.config.add_source_eos = True
    return spec


def trained_data(checkpoint: str) -> str:
    """The data directory in a checkpoint's cfg (task.data)."""
    from ..checkpoint.safe_load import read_checkpoint_file
    task = saved_task(read_checkpoint_file(checkpoint))
    data = trained_data_dir(task) if task is not None else None
    if not data:
        raise CheckpointError(f"{checkpoint} names no data directory: give --data")
    return data


def export(checkpoint: str, out: str, data: str | None = None,
           quantization: str = "float32") -> str:
    """Write the CTranslate2 model directory ``out`` (which must not exist or be empty) from
    ``checkpoint`` and its data directory (``data``, else the one in its cfg)."""
    need_ctranslate2()
    from ctranslate2.converters.converter import Converter
    data = data or trained_data(checkpoint)
    if not (Path(data) / "spm.model").is_file() or not (Path(data) / "langs.txt").is_file():
        raise CheckpointError(f"{data} is not a directory written by scripts/prepare_data.sh "
                              f"(spm.model, langs.txt): give --data")
    out_path = Path(out)
    if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory")
    if quantization not in QUANTIZATIONS:
        raise CheckpointError(f"unknown quantization {quantization!r}: one of "
                              f"{', '.join(QUANTIZATIONS)}")
    model, task, saved, source = load_fairseq(checkpoint, Path(data))
    spec = spec_of(model, task, saved)

    class Built(Converter):
        def _load(self):
            return spec

    Built().convert(str(out_path), quantization=quantization, force=True)
    shutil.copyfile(Path(data) / "spm.model", out_path / SPM_FILE)
    langs = list(_data_set(Path(data)).langs)
    config = {"languages": langs, "encoder_langtok": source.encoder_langtok,
              "decoder_langtok": source.decoder_langtok,
              "lang_tok_style": source.lang_tok_style, "language_token": "__{lang}__",
              "sentencepiece_model": SPM_FILE, "quantization": quantization,
              "exported_from": str(checkpoint)}
    (out_path / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out_path / "README.md").write_text(_readme(langs), encoding="utf-8")
    return str(out_path)


def _readme(langs: list[str]) -> str:
    a, b = (langs + langs)[:2]
    return f"""# NLLB model for CTranslate2 (exported by fairseq_fsdp2)

```python
import ctranslate2, sentencepiece
sp = sentencepiece.SentencePieceProcessor(model_file="{SPM_FILE}")
translator = ctranslate2.Translator(".", device="cpu")
source = [["__{a}__"] + sp.encode("your sentence", out_type=str)]   # </s> is appended
result = translator.translate_batch(source, target_prefix=[["__{b}__"]], beam_size=4)
print(sp.decode([t for t in result[0].hypotheses[0] if t != "__{b}__"]))  # without the tag
```

Languages ({len(langs)}): {", ".join(langs)}. nllb.json says the same for programs.
"""


def compute_type(precision: str) -> str:
    """CTranslate2's compute type for --precision (float32: the type the weights are stored
    in, so an int8 export computes in int8)."""
    return "default" if precision == "float32" else precision


def check_compute(gen: Generation) -> None:
    """The device can compute in --precision (else one line, before any generation)."""
    import ctranslate2
    gen = gen.resolved()
    wanted = compute_type(gen.precision)
    supported = ctranslate2.get_supported_compute_types(gen.device)
    if wanted != "default" and wanted not in supported:
        raise CheckpointError(f"--precision {gen.precision}: CTranslate2 cannot compute in it "
                              f"on {gen.device} here (it can: {', '.join(sorted(supported))})")


class CT2Translator:
    """A CTranslate2 directory translating the test set's sources (the binarized split's
    sources decoded, or the raw files), tags and ``</s>`` as the fairseq model has them."""

    def __init__(self, model: ModelSource, test: TestSet, gen: Generation):
        import ctranslate2
        import sentencepiece
        self.model, self.test, self.gen = model, test, gen.resolved()
        self.translator = ctranslate2.Translator(str(model.path), device=self.gen.device,
                                                 compute_type=compute_type(self.gen.precision))
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(model.path / SPM_FILE))

    def _sources_and_references(self, d: Direction) -> tuple[list[str], list[str]]:
        if self.test.raw is not None:
            return self.test.raw_lines(d, d.src), self.test.raw_lines(d, d.tgt)
        from fairseq.data import Dictionary, data_utils
        dictionary = Dictionary.load(str(self.test.dictionary))
        texts = []
        for lang in (d.src, d.tgt):
            binarized = pair_file(self.test.data, self.test.split, d, lang, ".bin")
            dataset = data_utils.load_indexed_dataset(str(binarized.with_suffix("")), dictionary)
            texts.append([self.sp.decode(dictionary.string(dataset[i]).split())
                          for i in range(len(dataset))])
        return texts[0], texts[1]

    def translate(self, d: Direction, progress=lambda it, **kw: it) -> Translations:
        sources, references = self._sources_and_references(d)
        tag = "__{}__"
        batch = [([tag.format(d.src)] if self.model.encoder_langtok == "src" else
                  [tag.format(d.tgt)] if self.model.encoder_langtok == "tgt" else []) +
                 self.sp.encode(s, out_type=str) for s in sources]
        prefix = [[tag.format(d.tgt)]] * len(batch) if self.model.decoder_langtok else None
        hyps = []
        step = self.gen.batch_size
        for start in progress(range(0, len(batch), step), total=-(-len(batch) // step)):
            chunk = batch[start:start + step]
            # fairseq's limit, a * source length (with its tag and </s>) + b tokens, the target
            # tag among them; here one limit per batch, its longest source's
            longest = max(len(s) + 1 for s in chunk)
            results = self.translator.translate_batch(
                chunk, target_prefix=prefix[start:start + step] if prefix else None,
                beam_size=self.gen.beam, length_penalty=self.gen.lenpen,
                max_decoding_length=int(self.gen.max_len_a * longest + self.gen.max_len_b),
                max_input_length=0)
            for r in results:
                # the target tag left out wherever it is, as fairseq's generator strips it
                # (symbols_to_strip_from_output), not only the forced first one
                hyps.append(self.sp.decode([t for t in r.hypotheses[0]
                                            if t != tag.format(d.tgt)]))
        return Translations(hyps, references, sources)
