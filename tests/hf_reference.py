"""The Hugging Face side of tests/test_hf_nllb.py: a program run in its own process with the
test-only transformers on its path (never in the pytest process or the fairseq ranks).

    python hf_reference.py make SPM_MODEL OUT_DIR REQUEST.json RESULT.json
        a tiny NLLB model as the hub has them, written by transformers itself: random weights
        (M2M100ForConditionalGeneration, saved with save_pretrained as safetensors), the
        SentencePiece model and the NllbTokenizer files; then what ``check`` computes.
    python hf_reference.py check MODEL_DIR REQUEST.json RESULT.json
        load MODEL_DIR with from_pretrained and compute, in eval mode:
        - ``logits`` of ``src`` (left-padded with 1) / ``prev`` (decoder input) token ids, and
          the same in float64 (``logits64``: the model converted with ``.double()``, its float32
          weights exact in float64);
        - greedy ``generate`` of each ``gen_src`` sentence (forced first token: the target
          language, as NLLB does), by the float64 model: its tokens;
        - the tokenizer's ids of ``texts`` (source side, ``src_lang``; and of each language's
          ``texts_by_lang``), its whole vocabulary (token -> id) and the ``generated`` tokens
          decoded to text, when MODEL_DIR has a tokenizer (tokenizer.json);
        - the config's ``vocab_size``.
    python hf_reference.py serve
        both, one request a line on stdin (``make SPM_MODEL OUT_DIR REQUEST.json RESULT.json``
        or ``check MODEL_DIR REQUEST.json RESULT.json``, JSON lists), one answer a line on
        stdout (``ok`` or the error): one process, whose transformers import (seconds) a test
        module pays once for its ``make`` and its ``check``; the tests fork it from their
        server (tests/forkserver.py), where torch is imported already.
"""
import copy
import json
import shutil
import sys
from pathlib import Path

import torch


def compute(model, tokenizer, request: dict) -> dict:
    result = {}
    src = torch.tensor(request["src"])
    model64 = copy.deepcopy(model).double()
    for key, m in (("logits", model), ("logits64", model64)):
        with torch.no_grad():
            out = m(input_ids=src, attention_mask=src.ne(1).long(),
                    decoder_input_ids=torch.tensor(request["prev"]))
        result[key] = out.logits.tolist()  # json writes float64 values exactly (repr)
    result["generated"] = [
        model64.generate(torch.tensor([ids]), num_beams=1, do_sample=False,
                       forced_bos_token_id=request["tgt_lang_id"],
                       max_new_tokens=request["max_new_tokens"])[0].tolist()
        for ids in request["gen_src"]]
    if tokenizer is not None:
        tokenizer.src_lang = request["src_lang"]
        result["text_ids"] = [tokenizer(t).input_ids for t in request["texts"]]
        result["vocab"] = tokenizer.get_vocab()
        result["decoded"] = [tokenizer.decode(ids, skip_special_tokens=True)
                             for ids in result["generated"]]
        result["texts_by_lang"] = {}
        for lang, texts in request.get("texts_by_lang", {}).items():
            tokenizer.src_lang = lang
            result["texts_by_lang"][lang] = [tokenizer(t).input_ids for t in texts]
    return result


def make(spm_model: str, out: Path, request: dict) -> dict:
    from transformers import AutoTokenizer, M2M100Config, M2M100ForConditionalGeneration
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    out.mkdir(parents=True)
    shutil.copyfile(spm_model, out / "sentencepiece.bpe.model")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "NllbTokenizer", "additional_special_tokens": FAIRSEQ_LANGUAGE_CODES}))
    tokenizer = AutoTokenizer.from_pretrained(out, src_lang=request["src_lang"])
    tokenizer.save_pretrained(out)
    # two rows more than the tokenizer has tokens, as NLLB-200's 256,206 for 256,204
    config = M2M100Config(vocab_size=len(tokenizer) + 2, **request["config"])
    torch.manual_seed(request["seed"])
    model = M2M100ForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    request = dict(request, tgt_lang_id=tokenizer.convert_tokens_to_ids(request["tgt_lang"]))
    return dict(compute(model, tokenizer, request), tgt_lang_id=request["tgt_lang_id"],
                vocab_size=config.vocab_size)


def check(model_dir: Path, request: dict) -> dict:
    from transformers import AutoTokenizer, M2M100ForConditionalGeneration

    model = M2M100ForConditionalGeneration.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir) \
        if (model_dir / "tokenizer.json").is_file() else None
    return dict(compute(model, tokenizer, request), vocab_size=model.config.vocab_size)


def run(argv: list[str]) -> None:
    """One ``make`` or ``check`` (the command line's words), its result written."""
    if argv[0] == "make":
        spm, out, req, res = argv[1:]
        result = make(spm, Path(out), json.loads(Path(req).read_text()))
    else:
        model_dir, req, res = argv[1:]
        result = check(Path(model_dir), json.loads(Path(req).read_text()))
    Path(res).write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] != "serve":
        run(sys.argv[1:])
        sys.exit(0)
    for line in sys.stdin:
        try:
            run(json.loads(line))
            answer = "ok"
        except Exception as e:  # the test shows it, with the traceback on stderr
            import traceback
            traceback.print_exc()
            answer = f"{type(e).__name__}: {e}".replace("\n", " ")
        print(answer, flush=True)
