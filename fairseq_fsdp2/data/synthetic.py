"""Random sentences over a large dictionary, binarized by fairseq-preprocess: data whose
vocabulary (not its meaning) matters, for memory validation and benchmarks."""
from __future__ import annotations

import random
from pathlib import Path

from .preprocess import run_preprocess


def write_random_corpus(root: Path, *, vocab: int, words: int, n_train: int,
                        prefix: str = "w") -> Path:
    """Write ``n_train`` training and 16 validation pairs of ``words``-word sentences (the
    target is the source reversed) over a ``vocab``-entry dictionary (fairseq's 4 special
    symbols included) under root/raw; binarize into root/bin and return it."""
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    symbols = vocab - 4  # fairseq adds <s> <pad> </s> <unk>
    with open(root / "dict.txt", "w") as f:
        f.writelines(f"{prefix}{i} {symbols - i}\n" for i in range(symbols))
    rng = random.Random(0)
    for split, n in (("train", n_train), ("valid", 16)):
        with open(raw / f"{split}.src", "w") as s, open(raw / f"{split}.tgt", "w") as t:
            for _ in range(n):
                sentence = [f"{prefix}{rng.randrange(symbols)}" for _ in range(words)]
                s.write(" ".join(sentence) + "\n")
                t.write(" ".join(reversed(sentence)) + "\n")
    out = root / "bin"
    run_preprocess(["--source-lang", "src", "--target-lang", "tgt",
                    "--trainpref", raw / "train", "--validpref", raw / "valid",
                    "--destdir", out, "--srcdict", root / "dict.txt",
                    "--tgtdict", root / "dict.txt", "--workers", "1"])
    return out
