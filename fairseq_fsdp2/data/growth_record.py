"""DATA/vocab_growth.json: the record of what growing a vocabulary added where (written by
data preparation, grown_vocab.py; read by fine-tuning, checkpoint/grown_embedding.py, to check
the checkpoint has the rows the dictionary was grown from). Its own module so that training
reads it without importing data preparation (SentencePiece and protobuf: 0.03 CPU-s of every
process that loads the plugin)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

#: the record of a grown vocabulary in the data directory
GROWTH_FILE = "vocab_growth.json"


def write_record(data_dir: Path, record: dict) -> None:
    (Path(data_dir) / GROWTH_FILE).write_text(
        json.dumps(record, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def read_record(data_dir: Path) -> Optional[dict]:
    path = Path(data_dir) / GROWTH_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
