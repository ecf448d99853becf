"""Fine-tuning into a bigger vocabulary: a pretrained model whose shared embedding has fewer
rows than the data's dictionary (languages and pieces added by ``scripts/prepare_data.sh
--add-langs/--add-pieces``, data/grown_vocab.py).

The dictionary must begin with the model's rows, in the model's order: it is refused (one line)
if it has fewer entries than the checkpoint has rows, if an entry differs from the checkpoint's
own dictionary (a Hugging Face model's tokenizer, hf/vocab.py; for a fairseq checkpoint the
``dict.txt`` beside it or the dictionary of the data it was trained on, when one is found), or if
the data records that it was grown from a model of another size (DATA/vocab_growth.json).
Then the pretrained rows are kept bit for bit and each new row starts as
- the row of the language named by ``--init-new-langs-from`` (a new language code's row), or
- the mean of all pretrained rows (every other new row: pieces, padding, languages not named),
computed on rank 0, which broadcasts the grown tensor as it broadcasts every other one
(checkpoint/full_state.py): the other ranks never hold more than their shards. The embedding
stays one tied weight (encoder input, decoder input, output projection).
"""
from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from ..data.growth_record import GROWTH_FILE, read_record
from ..errors import CheckpointError
from ..hf.nllb_weights import FAIRSEQ_EMBEDDING
from ..models.nllb_languages import lang_of_token
from ..options import EVERY_NEW_LANG

_CHUNK_ROWS = 16384  # rows summed at a time for the mean (a float64 copy of this many rows)


def more_rows(own: dict, saved: dict) -> Optional[tuple[int, int]]:
    """(checkpoint rows, model rows) if the checkpoint differs from the model only in the rows
    of the shared embedding, else None. ``own``/``saved``: name -> shape."""
    differ = {k for k in own if k in saved and tuple(saved[k]) != tuple(own[k])}
    if not differ or not differ <= set(FAIRSEQ_EMBEDDING):
        return None
    pairs = {(tuple(saved[k]), tuple(own[k])) for k in differ}
    if len(pairs) != 1:
        return None
    ((old, new),) = pairs
    return (old[0], new[0]) if len(old) == 2 and old[1:] == new[1:] else None


def smaller_dictionary(entries: int, rows: int, source: str) -> str:
    return (f"the dictionary has {entries} entries, fewer than the {rows} rows of the embedding "
            f"of {source}: a dictionary for fine-tuning begins with the model's rows, in its "
            f"order (scripts/prepare_data.sh with the model's --spm-model and --dict, or "
            f"--hf-model DIR; --add-langs and --add-pieces add entries after them)")


def checkpoint_dictionary(checkpoint: str, cfg) -> Optional[tuple[str, list[str]]]:
    """(file, symbols) of a fairseq checkpoint's own dictionary: ``dict.txt`` beside it, else
    the dictionary of the data it was trained on (its cfg's task.data), if still there."""
    from fairseq.data import Dictionary

    candidates = [os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "dict.txt")]
    task = cfg.get("task") if isinstance(cfg, dict) else None
    data = task.get("data") if isinstance(task, dict) else None
    if isinstance(data, str) and data:
        first = data.split(os.pathsep)[0]
        candidates += [os.path.join(first, "dict.txt"),
                       os.path.join(first, f"dict.{task.get('source_lang')}.txt"),
                       *sorted(glob.glob(os.path.join(first, "dict.*.txt")))]
    for path in candidates:
        if os.path.isfile(path):
            try:
                return path, list(Dictionary.load(path).symbols)
            except Exception:  # noqa: BLE001  (not a dictionary: nothing to compare with)
                continue
    return None


def dictionary_problem(symbols: Sequence[str], rows: int, source: str,
                       known: Optional[tuple[str, list[str]]],
                       data_dir: Optional[str]) -> Optional[str]:
    """Why ``symbols`` cannot extend the ``rows`` rows of ``source`` (one line), or None."""
    if len(symbols) < rows:
        return smaller_dictionary(len(symbols), rows, source)
    if known is not None:
        where, theirs = known
        for i in range(min(rows, len(theirs))):
            if symbols[i] != theirs[i]:
                return (f"dictionary entry {i} is {symbols[i]!r}, but row {i} of {source} is "
                        f"{theirs[i]!r} (its dictionary {where}): a dictionary for fine-tuning "
                        f"keeps the model's rows in their order, new entries after them "
                        f"(scripts/prepare_data.sh --add-langs/--add-pieces)")
    record = read_record(data_dir) if data_dir else None
    if record is not None and record.get("model_rows") != rows:
        return (f"the data's dictionary was grown from a model of {record.get('model_rows')} "
                f"rows ({os.path.join(data_dir, GROWTH_FILE)}), but {source} has {rows}: "
                f"prepare the data from this model (with --model-rows {rows} if its "
                f"dictionary file lists fewer entries)")
    return None


@dataclass(frozen=True)
class RowPlan:
    """How the embedding grows: ``copies`` maps a new row to the pretrained row it starts as;
    every other new row starts as the mean of the pretrained rows."""
    old_rows: int
    new_rows: int
    copies: dict

    def grow(self, weight: torch.Tensor) -> torch.Tensor:
        old = weight[: self.old_rows]
        total = torch.zeros(old.shape[1], dtype=torch.float64)
        for start in range(0, self.old_rows, _CHUNK_ROWS):  # no float64 copy of the whole
            total += old[start:start + _CHUNK_ROWS].to(torch.float64).sum(0)
        mean = (total / self.old_rows).to(old.dtype)
        new = mean.expand(self.new_rows - self.old_rows, -1).clone()
        for row, source in self.copies.items():
            new[row - self.old_rows] = old[source]
        return torch.cat([old, new])

    def describe(self, symbols: Sequence[str], source: str) -> str:
        by_source: dict[int, list[str]] = {}
        for row, origin in sorted(self.copies.items()):
            by_source.setdefault(origin, []).append(symbols[row])
        copied = "; ".join(f"{', '.join(tokens)} from the row of {symbols[origin]}"
                           for origin, tokens in by_source.items())
        rest = self.new_rows - self.old_rows - len(self.copies)
        parts = ([copied] if copied else []) + (
            [f"{rest} as the mean of the {self.old_rows} pretrained rows"] if rest else [])
        return (f"grew the shared embedding of {source} from {self.old_rows} to {self.new_rows} "
                f"rows for the dictionary's new entries (rows {self.old_rows}-"
                f"{self.new_rows - 1}): {'; '.join(parts)}; the pretrained rows are kept as "
                f"they are")


def plan_rows(symbols: Sequence[str], old_rows: int, sources: dict) -> RowPlan:
    """The RowPlan for ``--init-new-langs-from`` (``sources``: options.new_lang_sources)."""
    index = {s: i for i, s in enumerate(symbols)}
    new_langs = {code: r for r in range(old_rows, len(symbols))
                 if (code := lang_of_token(symbols[r]))}
    copies = {}
    for new, origin in sources.items():
        row = index.get(f"__{origin}__")
        if row is None or row >= old_rows:
            raise CheckpointError(f"--init-new-langs-from: {origin} is not a language of the "
                                  f"pretrained model (no __{origin}__ among its {old_rows} rows)")
        if new == EVERY_NEW_LANG:
            copies.update({r: row for r in new_langs.values()})
        elif new not in new_langs:
            raise CheckpointError(f"--init-new-langs-from: {new} is not a new language of the "
                                  f"dictionary (new: {', '.join(new_langs) or 'none'})")
        else:
            copies[new_langs[new]] = row
    return RowPlan(old_rows, len(symbols), copies)


class GrownWeights(Mapping):
    """A model's full weights with the shared embedding grown by a RowPlan (computed once,
    when first read); everything else is the wrapped mapping's."""

    def __init__(self, full: Mapping, plan: RowPlan):
        self._full, self._plan = full, plan
        self._grown: Optional[torch.Tensor] = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in FAIRSEQ_EMBEDDING:
            return self._full[name]
        if self._grown is None:
            self._grown = self._plan.grow(self._full[name])
        return self._grown

    def __iter__(self) -> Iterator[str]:
        return iter(self._full)

    def __len__(self) -> int:
        return len(self._full)


def grown(full: Mapping, own_rows: int, symbols: Sequence[str], source: str, sources: dict,
          known: Optional[Callable[[], Optional[tuple[str, list[str]]]]],
          data_dir: Optional[str]) -> tuple[Mapping, Optional[str]]:
    """``full`` (rank 0's weights of ``source``) for a model of ``own_rows`` embedding rows:
    unchanged if they fit, else grown, with the one line saying how. CheckpointError if the
    dictionary cannot extend the checkpoint's rows. ``known``: finds the checkpoint's own
    dictionary (checkpoint_dictionary), called only if the embedding grows."""
    rows = full[FAIRSEQ_EMBEDDING[0]].shape[0] if FAIRSEQ_EMBEDDING[0] in full else own_rows
    if rows == own_rows:
        return full, None
    problem = dictionary_problem(symbols, rows, source, known() if known else None, data_dir)
    if problem:
        raise CheckpointError(problem)
    plan = plan_rows(symbols, rows, sources)
    return GrownWeights(full, plan), plan.describe(symbols, source)
