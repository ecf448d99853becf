"""What a model argument names, read and checked before any generation.

A fairseq checkpoint file the project reads: a sharded FSDP2 checkpoint (its full weights are
read from its shard directory by the plugin's loading patch, a LoRA checkpoint's adapters
merged: checkpoint/export.py), a consolidated export, or a stock fairseq checkpoint. Or a
Hugging Face NLLB directory (hf_model.py), or a CTranslate2 model directory
(``consolidate --format ctranslate2``). The check reads headers
only (memory-mapped tensors, DCP metadata): the embedding rows must be DATA's dictionary's, the
task NLLB's (``translation_multi_simple_epoch``), and its language-tag settings are what
generation forces (as the recipe trained it).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..checkpoint import sharded
from ..checkpoint.export import plain_config
from ..checkpoint.safe_load import read_checkpoint_file
from ..errors import CheckpointError
from ..hf.nllb_weights import FAIRSEQ_EMBEDDING, HFWeights, is_hf_source
from ..hf.vocab import SPM_FILE, dictionary_problem

#: the task NLLB trains and fine-tunes with (the recipe's)
NLLB_TASK = "translation_multi_simple_epoch"
#: files that make a directory a CTranslate2 model
CT2_FILES = ("model.bin", "config.json")
#: what the export adds to a CTranslate2 directory (ctranslate2_export.py): how NLLB's tags are
#: given, and the SentencePiece model
CT2_CONFIG, CT2_SPM = "nllb.json", "sentencepiece.model"


@dataclass(frozen=True)
class ModelSource:
    """A checked model: ``kind`` "fairseq" (a checkpoint file), "hf" or "ctranslate2";
    ``label`` names it in the table; the language-tag settings of its training task."""

    path: Path
    kind: str
    label: str
    rows: int
    encoder_langtok: Optional[str] = "src"
    decoder_langtok: bool = True
    lang_tok_style: str = "multilingual"


def saved_task(state: dict) -> Optional[dict]:
    """The task config a checkpoint's ``cfg`` holds, as a plain dict (None if it holds none)."""
    cfg = plain_config(state.get("cfg"))
    task = cfg.get("task") if isinstance(cfg, dict) else None
    return task if isinstance(task, dict) else None


def trained_data_dir(task: dict) -> Optional[str]:
    """The first data directory the task trained on (fairseq's ``data`` is a list of
    directories joined by os.pathsep), or None."""
    data = task.get("data")
    return data.split(os.pathsep)[0] if isinstance(data, str) and data else None


def _rows_of_shards(path: str, info: dict) -> Optional[int]:
    """The embedding rows recorded in a sharded checkpoint's DCP metadata (a LoRA checkpoint's
    embedding is in its frozen base's directory unless it trained)."""
    for rel in (info.get("shards"), info.get("lora_base")):
        if not rel:
            continue
        shapes = sharded.saved_shapes(sharded.read_metadata(sharded.resolve(path, rel), path))
        for name in FAIRSEQ_EMBEDDING:
            if shapes.get(name) is not None:
                return int(shapes[name][0])
    return None


def _dictionary_size(dictionary: Path) -> int:
    from fairseq.data import Dictionary
    return len(Dictionary.load(str(dictionary)))


def fairseq_checkpoint(path: Path, label: str, dictionary: Path) -> ModelSource:
    state = read_checkpoint_file(str(path))  # memory-mapped: no weight is read
    task = saved_task(state)
    if task is None:  # a legacy checkpoint keeps its args instead
        task = plain_config(state.get("args")) or {}
    name = task.get("_name") or task.get("task")
    if name is not None and name != NLLB_TASK:  # none named: NLLB's settings assumed
        raise CheckpointError(f"{path} was trained with task {name!r}: evaluation translates "
                              f"NLLB-style models ({NLLB_TASK}, language tags)")
    info = state.get("fsdp2")
    if isinstance(info, dict):
        rows = _rows_of_shards(str(path), info)
    else:
        model = state["model"]
        rows = next((int(model[n].shape[0]) for n in FAIRSEQ_EMBEDDING if n in model), None)
    if rows is None:
        raise CheckpointError(f"{path} holds no token embedding ({FAIRSEQ_EMBEDDING[0]})")
    entries = _dictionary_size(dictionary)
    if rows != entries:
        raise CheckpointError(f"{path} has {rows} embedding rows, {dictionary} {entries} "
                              f"entries: the model was trained with another dictionary")
    trained = trained_data_dir(task)
    if trained:
        theirs = Path(trained) / "dict.txt"
        if theirs.is_file() and theirs.resolve() != dictionary.resolve() and \
                theirs.read_bytes() != dictionary.read_bytes():
            raise CheckpointError(f"{path} was trained with {theirs}, which differs from "
                                  f"{dictionary}: the model was trained with another "
                                  f"dictionary")
    return ModelSource(path, "fairseq", label, rows,
                       encoder_langtok=task.get("encoder_langtok", "src"),
                       decoder_langtok=bool(task.get("decoder_langtok", True)),
                       lang_tok_style=task.get("lang_tok_style", "multilingual"))


def is_ctranslate2(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in CT2_FILES)


def need_ctranslate2() -> None:
    """ctranslate2 is importable (requirements.txt pins it), or one line saying how to get it."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise CheckpointError("ctranslate2 is not installed: pip install ctranslate2==4.8.5 "
                              "(scripts/setup.sh installs requirements.txt)") from None


def ct2_vocabulary(symbols) -> list[str]:
    """A fairseq dictionary's symbols as CTranslate2's vocabulary names them (its padding token
    is ``<blank>``)."""
    return ["<blank>" if t == "<pad>" else t for t in symbols]


def ct2_source(path: Path, label: str, dictionary: Path) -> ModelSource:
    """A CTranslate2 directory written by ``export``, checked against DATA's dictionary."""
    need_ctranslate2()
    config_file = path / CT2_CONFIG
    if not config_file.is_file() or not (path / CT2_SPM).is_file():
        raise CheckpointError(f"{path} is a CTranslate2 model without {CT2_CONFIG} and "
                              f"{CT2_SPM}: export it with python -m fairseq_fsdp2.consolidate "
                              f"--format ctranslate2")
    from fairseq.data import Dictionary
    ours = ct2_vocabulary(Dictionary.load(str(dictionary)).symbols)
    vocab_file = next((path / f for f in ("shared_vocabulary.json", "source_vocabulary.json")
                       if (path / f).is_file()), None)
    theirs = json.loads(vocab_file.read_text(encoding="utf-8")) if vocab_file else None
    if theirs != ours:
        raise CheckpointError(f"{path}'s vocabulary ({len(theirs or [])} tokens) is not "
                              f"{dictionary}'s ({len(ours)}): the model was trained with "
                              f"another dictionary")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    return ModelSource(path, "ctranslate2", label, len(ours),
                       encoder_langtok=config.get("encoder_langtok"),
                       decoder_langtok=bool(config.get("decoder_langtok", True)),
                       lang_tok_style=config.get("lang_tok_style", "multilingual"))


def hf_source(path: Path, label: str, dictionary: Path) -> ModelSource:
    """A Hugging Face NLLB directory, checked against DATA's dictionary (no weight read;
    hf_model.py builds the model)."""
    from fairseq.data import Dictionary
    weights = HFWeights(str(path))
    rows = weights.shape(FAIRSEQ_EMBEDDING[0])[0]
    symbols = Dictionary.load(str(dictionary)).symbols
    problem = f"{path} has {rows} embedding rows, {dictionary} {len(symbols)} entries: the " \
        f"model was trained with another dictionary" if len(symbols) != rows else None
    if problem is None and (path / SPM_FILE).is_file():  # its tokenizer: every row's token
        problem = dictionary_problem(path, symbols, rows)
    if problem:
        raise CheckpointError(problem)
    return ModelSource(path, "hf", label, rows)


def model_source(path: str, label: str, dictionary: Path) -> ModelSource:
    """The checked model ``path`` names; CheckpointError names the first problem."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"model not found: {path}")
    if is_ctranslate2(p):
        return ct2_source(p, label, dictionary)
    if p.is_dir() and is_hf_source(path):
        return hf_source(p, label, dictionary)
    if p.is_dir():
        raise CheckpointError(f"{path} is a directory, but neither a CTranslate2 model "
                              f"({' + '.join(CT2_FILES)}) nor a checkpoint file")
    return fairseq_checkpoint(p, label, dictionary)
