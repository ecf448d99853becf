"""fairseq dictionary files (``dict.txt``: one ``token count`` line per entry after fairseq's
four specials ``<s> <pad> </s> <unk>``), as data preparation reads, builds and pads them."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Sequence

from .inputs import PrepareError

FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
#: fairseq's name for the entries that pad a dictionary (Dictionary.pad_to_multiple_)
PADDING = "madeupword{:04d}"


def lang_token(lang: str) -> str:
    """The token translation_multi_simple_epoch uses for a language (its default
    ``--lang-tok-style multilingual``)."""
    return f"__{lang}__"


def read_dict_tokens(path: Path) -> list[str]:
    """Tokens of a fairseq dictionary file (``token count [#fairseq:overwrite]`` lines)."""
    tokens = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            fields = line.rstrip("\n").split(" ")
            if fields[-1] == "#fairseq:overwrite":
                fields = fields[:-1]
            if len(fields) != 2 or not fields[0] or not fields[1].lstrip("-").isdigit():
                raise PrepareError(f"{path}:{number}: not a fairseq dictionary line "
                                   "('<token> <count>')")
            tokens.append(fields[0])
    return tokens


def read_dict_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def build_dictionary(encoded_train: Sequence[Path], append_langs: Sequence[str],
                     base: Optional[Path]) -> list[str]:
    """Lines of the shared dictionary: base's lines (or the encoded training pieces, most
    frequent first, ties by piece), then ``__lang__ 1`` for each language not yet in it."""
    if base is not None:
        lines = read_dict_lines(base)
        present = set(read_dict_tokens(base))
    else:
        counts = Counter()
        for path in encoded_train:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    counts.update(line.split())
        for token in (*FAIRSEQ_SPECIALS, *map(lang_token, append_langs)):
            counts.pop(token, None)
        lines = [f"{tok} {n}" for tok, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        present = set(counts)
    lines += [f"{lang_token(lang)} 1" for lang in append_langs if lang_token(lang) not in present]
    return lines


def padding_lines(tokens: Iterable[str], entries: int, factor: int) -> list[str]:
    """The lines fairseq's ``Dictionary.pad_to_multiple_(factor)`` would add to a dictionary of
    ``entries`` entries (specials included) holding ``tokens``: ``madeupwordNNNN 0`` until the
    size is a multiple of ``factor``, skipping names already present."""
    present, lines, i = set(tokens), [], 0
    while factor > 1 and (entries + len(lines)) % factor:
        name = PADDING.format(i)
        if name not in present:
            lines.append(f"{name} 0")
        i += 1
    return lines
