"""A tiny synthetic translation corpus, binarized with fairseq-preprocess (real fairseq data).

Target sentences are source sentences with every word mapped to its "translation" and the order
reversed, so a model can learn it and its loss falls within a few updates.
"""
from __future__ import annotations

import random
from pathlib import Path

from fairseq_fsdp2.data.preprocess import run_preprocess

SRC_WORDS = [f"s{i}" for i in range(40)]
TGT_WORDS = [f"t{i}" for i in range(40)]


def write_split(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path.with_suffix(".src"), "w") as s, open(path.with_suffix(".tgt"), "w") as t:
        for _ in range(n):
            idx = [rng.randrange(len(SRC_WORDS)) for _ in range(rng.randint(3, 12))]
            s.write(" ".join(SRC_WORDS[i] for i in idx) + "\n")
            t.write(" ".join(TGT_WORDS[i] for i in reversed(idx)) + "\n")


def make_corpus(root: Path, n_train: int = 2000, n_valid: int = 100) -> Path:
    """Write raw text under root/raw and binarize into root/bin; returns the bin dir."""
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    write_split(raw / "train", n_train, seed=1)
    write_split(raw / "valid", n_valid, seed=2)
    bin_dir = root / "bin"
    run_preprocess(["--source-lang", "src", "--target-lang", "tgt", "--trainpref", raw / "train",
                    "--validpref", raw / "valid", "--destdir", bin_dir, "--joined-dictionary",
                    "--workers", "1"])
    return bin_dir
