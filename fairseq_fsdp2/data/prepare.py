"""Turn raw parallel text into the binarized layout fairseq's ``translation_multi_simple_epoch``
task (the task NLLB-200 trains and fine-tunes with) reads.

Input, in RAW_DIR: one plain-text file per language pair, split and side, one sentence a line,
named ``{split}.{src}-{tgt}.{lang}`` (``train.eng_Latn-fra_Latn.eng_Latn``) with NLLB language
codes. ``train`` is required for every pair, ``valid`` and ``test`` are optional.

Steps: validate everything first (so a bad input fails in a second, not after encoding); train a
SentencePiece model on the training text unless ``--spm-model`` is given; encode; build a fairseq
dictionary from the encoded training text unless ``--dict`` is given, and append the language
tokens (``__eng_Latn__ 1``) at its end, where NLLB has them; binarize each pair with
``fairseq_cli.preprocess`` using that one dictionary on both sides.

Output, in DEST: ``{split}.{src}-{tgt}.{lang}.{bin,idx}``, ``dict.{lang}.txt`` for every language
of the data (copies of the one shared dictionary), ``dict.txt`` (the same), ``spm.model``,
``langs.txt`` and ``lang_pairs.txt`` (comma-separated, ready for ``--langs`` and
``--lang-pairs``). With ``--hf-model DIR`` (Hugging Face NLLB weights) the SentencePiece model
and the dictionary come from DIR: every token on the row HF's tokenizer gives it, the model's
languages in its order (hf/vocab.py), and its tokenizer files go to DEST/hf_tokenizer (for the
export back to Hugging Face). ``--add-langs``, ``--add-pieces`` and ``--train-pieces`` grow the
vocabulary of a pretrained model (grown_vocab.py). Everything is written into a temporary
directory next to DEST and renamed at the end, so a failed run leaves no half-written DEST
behind.

Errors are one line on stderr starting ``prepare_data: error:``, with exit status 2.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import sentencepiece as spm

from ..errors import report_bad_input, unwritable
from ..hf.vocab import FILLER, dictionary_for
from ..models.nllb_languages import NLLB200_LANGS
from . import grown_vocab
from .dictionary import FAIRSEQ_SPECIALS, build_dictionary, read_dict_tokens
from .inputs import SPLITS, Pair, PrepareError, discover_pairs, parse_pairs, plan_splits, \
    read_lines
from .preprocess import PreprocessError, run_preprocess
from .spm_model import read_pieces_file, train_spm

__all__ = ["PrepareError", "main", "prepare", "read_lines", "train_spm"]


def binarize(pair: Pair, splits: Sequence[str], encoded_dir: Path, dictionary: Path,
             out_dir: Path, workers: int) -> None:
    """One fairseq-preprocess run for a pair, the shared dictionary on both sides."""
    argv = ["--source-lang", pair.src, "--target-lang", pair.tgt,
            "--srcdict", str(dictionary), "--tgtdict", str(dictionary),
            "--destdir", str(out_dir), "--workers", str(workers), "--dataset-impl", "mmap"]
    for split in splits:
        argv += [f"--{split}pref", str(encoded_dir / f"{split}.{pair.name}")]
    try:
        run_preprocess(argv)
    except PreprocessError as exc:
        raise PrepareError(f"fairseq-preprocess failed for {pair.name}: {exc}") from None


def pad_to_rows(dict_lines: list[str], rows: int) -> list[str]:
    """``dict_lines`` (after fairseq's 4 specials) padded with fairseq's filler entries to
    ``rows`` entries in all, the embedding rows of the model to fine-tune (NLLB-200's fairseq
    checkpoints: 256,206 rows for a dictionary.txt and 202 languages of 256,203 entries)."""
    entries = len(dict_lines) + len(FAIRSEQ_SPECIALS)
    if rows < entries:
        raise PrepareError(f"--model-rows {rows} is fewer than the dictionary's {entries} "
                           f"entries (with the language tokens)")
    return dict_lines + [f"{FILLER.format(row)} 0" for row in range(entries, rows)]


def prepare(raw_dir: Path, dest: Path, *, lang_pairs: Optional[str] = None,
            spm_model: Optional[Path] = None, vocab_size: int = 8000,
            spm_type: str = "unigram", spm_max_sentences: int = 1_000_000,
            dictionary: Optional[Path] = None, dict_langs: str = "data",
            allow_non_nllb_langs: bool = False, workers: int = 1, overwrite: bool = False,
            seed: int = 1, hf_model: Optional[Path] = None, add_langs: Optional[str] = None,
            add_pieces: Optional[Path] = None, train_pieces: int = 0,
            model_rows: Optional[int] = None, padding_factor: int = 8, log=print) -> Path:
    """Validate, encode and binarize raw_dir into dest (see the module docstring)."""
    raw_dir, dest = Path(raw_dir), Path(dest)
    if not raw_dir.is_dir():
        raise PrepareError(f"raw data directory {raw_dir} does not exist")
    if dest.exists() and not dest.is_dir():
        raise PrepareError(f"destination {dest} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise PrepareError(f"destination {dest} exists and is not empty (use --overwrite)")
    problem = unwritable(str(dest.parent))  # DEST is built beside it, then renamed
    if problem:
        raise PrepareError(f"destination {dest} cannot be written: {problem}")
    for name, path in (("--spm-model", spm_model), ("--dict", dictionary),
                       ("--add-pieces", add_pieces)):
        if path is not None and not Path(path).is_file():
            raise PrepareError(f"{name} file {path} does not exist")
    if dictionary is not None:
        read_dict_tokens(Path(dictionary))
    if train_pieces < 0 or padding_factor < 1:
        raise PrepareError("--train-pieces must be >= 0 and --padding-factor >= 1")
    added = grown_vocab.parse_add_langs(add_langs)
    growing = bool(added or add_pieces or train_pieces)
    if model_rows is not None and (dictionary is None or hf_model is not None):
        raise PrepareError("--model-rows applies to a model given by --spm-model and --dict "
                           "(its embedding rows, when the dictionary lists fewer)")
    hf_lines, base = None, None
    if hf_model is not None:
        if spm_model is not None or dictionary is not None:
            raise PrepareError("--hf-model brings its own SentencePiece model and dictionary: "
                               "leave out --spm-model and --dict")
        try:
            spm_model, hf_lines, hf_langs = dictionary_for(Path(hf_model))
        except ValueError as e:
            raise PrepareError(f"--hf-model: {e}") from None
    if growing:
        base = grown_vocab.base_vocabulary(hf_model, spm_model, dictionary, dict_langs,
                                          model_rows)
        grown_vocab.check_new_langs(base, added)
        if add_pieces is not None:
            read_pieces_file(add_pieces)

    pairs = (parse_pairs(lang_pairs, allow_non_nllb_langs, added) if lang_pairs
             else discover_pairs(raw_dir, allow_non_nllb_langs, added))
    if not pairs:
        raise PrepareError(f"no {{split}}.{{src}}-{{tgt}}.{{lang}} files in {raw_dir}")
    plan = plan_splits(raw_dir, pairs)
    langs = sorted({lang for p in pairs for lang in (p.src, p.tgt)})
    # language tokens for the dictionary, in this order; also written to langs.txt
    append_langs = langs if dict_langs == "data" else \
        list(NLLB200_LANGS) + [lang for lang in langs if lang not in NLLB200_LANGS]
    if hf_lines is not None:
        append_langs = hf_langs
    if base is not None:
        append_langs = base.langs + added
    if hf_lines is not None or base is not None:
        missing = [lang for lang in langs if lang not in append_langs]
        if missing:
            where = f"the tokenizer of {hf_model}" if hf_lines is not None else \
                f"the dictionary {dictionary}"
            raise PrepareError(f"language {missing[0]} is not in {where}: add it to the model "
                               f"with --add-langs {missing[0]}")

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        work = tmp / "_work"
        (work / "encoded").mkdir(parents=True)
        growth = None
        if spm_model is None:
            train_text = [line for (pair, split) in plan if split == "train"
                          for lang in (pair.src, pair.tgt)
                          for line in read_lines(pair.raw(raw_dir, split, lang))]
            log(f"training a {spm_type} SentencePiece model, vocab {vocab_size}, "
                f"on {len(train_text)} lines")
            model = train_spm(train_text, work / "spm", vocab_size, spm_type,
                              spm_max_sentences, seed)
        else:
            model = Path(spm_model)
        if base is not None:
            new_text = [line for (pair, split) in plan if split == "train"
                        for lang in (pair.src, pair.tgt) if lang in added or not added
                        for line in read_lines(pair.raw(raw_dir, split, lang))]
            pieces, origin = grown_vocab.pieces_to_add(base, add_pieces, train_pieces, new_text,
                                                      work, seed)
            model, growth = grown_vocab.grow(base, added, pieces, origin, work)
        try:
            sp = spm.SentencePieceProcessor(model_file=str(model))
        except (OSError, RuntimeError) as e:
            raise PrepareError(f"cannot load SentencePiece model {model}: {e}") from None

        encoded_train = []
        for (pair, split), n in plan.items():
            for lang in (pair.src, pair.tgt):
                out = work / "encoded" / f"{split}.{pair.name}.{lang}"
                pieces = sp.encode(read_lines(pair.raw(raw_dir, split, lang)), out_type=str)
                out.write_text("".join(" ".join(p) + "\n" for p in pieces), encoding="utf-8")
                if split == "train":
                    encoded_train.append(out)
            log(f"encoded {split} {pair.name}: {n} lines")

        if growth is not None:
            grown_vocab.complete(growth, encoded_train, padding_factor)
            log(f"growing the model's {base.rows} rows by new language codes: "
                f"{', '.join(growth.langs) or 'none'}; new pieces: {len(growth.pieces)}; "
                f"pieces of the model's SentencePiece model not yet in its dictionary: "
                f"{len(growth.listed)}; padding entries: {len(growth.padding)}")
            dict_lines = growth.dictionary_lines()
            grown_vocab.write_outputs(growth, model, tmp)
        else:
            dict_lines = hf_lines or build_dictionary(encoded_train, append_langs,
                                                      Path(dictionary) if dictionary else None)
            if model_rows is not None:  # the checkpoint's rows past the dictionary's: fillers
                dict_lines = pad_to_rows(dict_lines, model_rows)
            if hf_model is not None:
                grown_vocab.copy_hf_tokenizer(Path(hf_model), model, tmp)
        dict_path = tmp / "dict.txt"
        dict_path.write_text("".join(line + "\n" for line in dict_lines), encoding="utf-8")
        log(f"dictionary: {len(dict_lines) + len(FAIRSEQ_SPECIALS)} entries "
            f"(with {len(FAIRSEQ_SPECIALS)} specials and language tokens)")

        for pair in pairs:
            splits = [s for s in SPLITS if (pair, s) in plan]
            binarize(pair, splits, work / "encoded", dict_path, tmp, workers)
            log(f"binarized {pair.name}: {', '.join(splits)}")

        for lang in langs:  # identical copies: the task loads one dictionary per language
            shutil.copyfile(dict_path, tmp / f"dict.{lang}.txt")
        shutil.copyfile(model, tmp / "spm.model")
        (tmp / "langs.txt").write_text(",".join(append_langs) + "\n")
        (tmp / "lang_pairs.txt").write_text(",".join(p.name for p in pairs) + "\n")
        shutil.rmtree(work)

        # Swap in: the old DEST (empty, or replaced with --overwrite) goes only once all is done.
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
            os.replace(tmp, dest)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    log(f"wrote {dest}")
    return dest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_fsdp2.data.prepare",
        description="Encode and binarize raw parallel text for translation_multi_simple_epoch.")
    parser.add_argument("raw_dir", type=Path, help="files named {split}.{src}-{tgt}.{lang}")
    parser.add_argument("dest", type=Path, help="output directory (must not exist or be empty)")
    parser.add_argument("--lang-pairs", help="comma-separated SRC-TGT pairs to prepare "
                        "(default: every pair found in RAW_DIR)")
    parser.add_argument("--spm-model", type=Path,
                        help="existing SentencePiece model (default: train one)")
    parser.add_argument("--vocab-size", type=int, default=8000,
                        help="size of the SentencePiece model to train")
    parser.add_argument("--spm-type", choices=("unigram", "bpe"), default="unigram")
    parser.add_argument("--spm-max-sentences", type=int, default=1_000_000,
                        help="train SentencePiece on at most this many training lines")
    parser.add_argument("--dict", type=Path, dest="dictionary",
                        help="existing fairseq dictionary (default: built from the data)")
    parser.add_argument("--dict-langs", choices=("data", "nllb200"), default="data",
                        help="language tokens appended to the dictionary: the data's languages, "
                        "or all 202 NLLB-200 languages in NLLB's order (as the NLLB-200 "
                        "checkpoints expect, with the NLLB --spm-model and --dict)")
    parser.add_argument("--hf-model", type=Path,
                        help="a Hugging Face NLLB model directory (config.json, "
                        "sentencepiece.bpe.model, tokenizer files): encode with its "
                        "SentencePiece model and write the dictionary that puts every token "
                        "on the embedding row of its tokenizer, for --finetune-from-model DIR")
    parser.add_argument("--add-langs", help="comma-separated language codes the model does not "
                        "have (e.g. xxx_Latn,yyy_Cyrl): their __xxx_Latn__ tokens follow the "
                        "model's rows in the dictionary, and the language pairs may use them "
                        "(needs the model's vocabulary: --hf-model, or --spm-model and --dict)")
    parser.add_argument("--add-pieces", type=Path, help="SentencePiece pieces to add, one a "
                        "line ('piece' or 'piece score'; a SentencePiece .vocab file works): "
                        "those the model's SentencePiece model lacks go into a copy of it "
                        "(DEST/spm.model) and into the dictionary after the model's rows")
    parser.add_argument("--train-pieces", type=int, default=0, metavar="N",
                        help="train a SentencePiece model of N pieces (of the model's type) on "
                        "the training text of the --add-langs languages (of all the data "
                        "without --add-langs) and add its pieces that the model lacks, as "
                        "--add-pieces does")
    parser.add_argument("--model-rows", type=int,
                        help="a fairseq model's embedding rows (--spm-model, --dict), when the "
                        "dictionary lists fewer (NLLB-200's dictionary.txt with its 202 "
                        "languages has 256,203 entries, its checkpoints 256,206 rows): the rows "
                        "in between are fairseq's madeupwordNNNN fillers; when growing, the new "
                        "entries come after them")
    parser.add_argument("--padding-factor", type=int, default=8,
                        help="a grown dictionary is padded with madeupwordNNNN entries to a "
                        "multiple of this many entries, as fairseq-preprocess pads (1: none)")
    parser.add_argument("--allow-non-nllb-langs", action="store_true",
                        help="accept well-formed codes that are not NLLB-200 languages")
    parser.add_argument("--workers", type=int, default=1, help="fairseq-preprocess workers")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DEST")
    parser.add_argument("--quiet", action="store_true")
    args = vars(parser.parse_args(argv))
    quiet = args.pop("quiet")
    try:
        prepare(**args, log=(lambda *a: None) if quiet else print)
    except PrepareError as e:  # bad input: one line, exit status 2, as the plugin's commands
        return report_bad_input("prepare_data", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
