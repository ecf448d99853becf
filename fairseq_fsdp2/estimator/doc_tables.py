"""The predicted tables of the docs, made by the estimator: every predicted figure a user reads
comes from an estimator command recorded beside its table, so it can be traced and re-run.

A table sits in a document between ``<!-- predicted: NAME -->`` and ``<!-- predicted: end -->``:
the table, then the command of each row. ``scripts/predicted_tables.py`` rewrites every block
from ``TABLES``; ``tests/test_predicted_tables.py`` fails when a block differs from what the
estimator prints today (a figure that went stale, a command that changed).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Optional

from .fit import largest_max_tokens
from .from_args import ModelCache, estimates, parse

ESTIMATE = "python -m fairseq_fsdp2.estimate"
END = "<!-- predicted: end -->"

#: NLLB-200's dictionary and the GPU runs the tables are about: fp16, 4096 tokens per GPU, Adam.
NLLB_GPU = ("unused", "--task", "translation", "--vocab-size", "256206", "--ddp-backend",
            "fsdp2", "--optimizer", "adam", "--max-tokens", "4096", "--fp16")
#: The fine-tuning recipe's memory settings (scripts/finetune_nllb.sh, configs/): one unit per
#: layer, the chunked loss (256 tokens), root reshard, the tied-gradient buffer (its default).
RECIPE = ("--min-params-to-wrap", "1", "--criterion", "label_smoothed_cross_entropy_chunked",
          "--loss-chunk-tokens", "256", "--fsdp2-root-reshard", "always")
#: Before the recipe had them: NLLB's own wrapping threshold and fairseq's criterion, the
#: stock tied gradients, PyTorch's root default.
STOCK = ("--min-params-to-wrap", "100000000", "--criterion", "label_smoothed_cross_entropy",
         "--fsdp2-root-reshard", "default", "--fsdp2-no-tied-grad-buffer")
CKPT = ("--checkpoint-activations",)
#: Adam's moments in 16 bits (optimizer/adam_stats.py); --bf16 --bf16-adam-stats: the same bytes
STATS16 = ("--fp16-adam-stats",)
#: ... in 8 bits (optimizer/moments/blockwise_8bit.py), with the gradients reduce-scattered in fp16
STATS8 = ("--eight-bit-adam-stats",)
REDUCE16 = ("--fsdp2-reduce-dtype", "fp16")
#: LoRA (docs/lora.md): adapters of rank 16 on the default modules, the base frozen in fp16
LORA = ("--lora-rank", "16")
#: what a 24 GB GPU leaves for tensors: 22.4 GiB less a 2 GiB margin (CUDA context, NCCL,
#: fragmentation)
GPU_24GB_BUDGET = 20.4
#: ... and a 16 GB GPU (two T4s, V100-16GB, 4060 Ti): 14.9 GiB less about 1.4 (CUDA context,
#: NCCL)
GPU_16GB_BUDGET = 13.5


@dataclass(frozen=True)
class Row:
    """One row: its label cells, and the estimator arguments that give its figures (one per
    world size of the table)."""

    labels: tuple[str, ...]
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    name: str
    document: str  # relative to the repository
    label_header: tuple[str, ...]
    world_sizes: tuple[int, ...]
    rows: tuple[Row, ...]
    #: a table of the largest --max-tokens that fits each of these many GiB per GPU (estimator
    #: --fit-gb: a column per budget and world size) instead of peaks
    fit_gb: tuple[float, ...] = ()

    def command(self, row: Row, budget: float | None = None) -> list[str]:
        fit = [] if budget is None else ["--fit-gb", f"{budget:g}"]
        return [*row.argv, "--world-size", *map(str, self.world_sizes), *fit]


def _nllb(size: str, *flags: str, max_tokens: int = 4096) -> tuple[str, ...]:
    base = tuple(str(max_tokens) if before == "--max-tokens" else arg
                 for before, arg in zip(("",) + NLLB_GPU, NLLB_GPU))
    return (*base, "--arch", f"transformer_nllb_{size}", *flags)


def _nllb_bf16_weights(size: str, *flags: str, max_tokens: int = 2048) -> tuple[str, ...]:
    """_nllb's run with bf16 weights and no fp32 master (--memory-efficient-bf16) in place of
    --fp16."""
    return tuple("--memory-efficient-bf16" if arg == "--fp16" else arg
                 for arg in _nllb(size, *flags, max_tokens=max_tokens))


#: one GPU, no fp32 master: bf16 weights (stochastic rounding), 8-bit moments, bf16 gradients
ONE_GPU = (*RECIPE, *CKPT, *STATS8, "--fsdp2-reduce-dtype", "bf16")


#: Adam stepped inside backward, each gradient freed once stepped (optimizer/step_in_backward.py;
#: needs --clip-norm 0, fairseq's default, and --update-freq 1)
IN_BACKWARD = ("--fsdp2-step-in-backward",)
ONE_GPU_FLAGS = ("`--memory-efficient-bf16 --eight-bit-adam-stats --fsdp2-reduce-dtype bf16 "
                 "--checkpoint-activations")


def _one_gpu_rows() -> tuple[Row, ...]:
    return tuple(Row((label, f"{ONE_GPU_FLAGS}`"), _nllb_bf16_weights(size, *ONE_GPU))
                 for label, size in (("600M", "600m"), ("1.3B", "1_3b"), ("3.3B", "3_3b"))) + (
        Row(("3.3B", f"{ONE_GPU_FLAGS} --fsdp2-step-in-backward`"),
            _nllb_bf16_weights("3_3b", *ONE_GPU, *IN_BACKWARD)),)


def _fitting_rows() -> tuple[Row, ...]:
    rows = []
    for label, size in (("600M", "600m"), ("1.3B", "1_3b"), ("3.3B", "3_3b")):
        rows.append(Row((label, "-"), _nllb(size, *RECIPE)))
        rows.append(Row((label, "`--checkpoint-activations`"), _nllb(size, *RECIPE, *CKPT)))
    rows.append(Row(("3.3B", "`--checkpoint-activations --cpu-offload`"),
                    _nllb("3_3b", *RECIPE, *CKPT, "--cpu-offload")))
    # 16-bit Adam moments: the end of backward sets the 2-GPU peak up to 12288 tokens per GPU
    rows.append(Row(("3.3B", "`--checkpoint-activations --fp16-adam-stats`"),
                    _nllb("3_3b", *RECIPE, *CKPT, *STATS16)))
    rows.append(Row(("3.3B", "`--checkpoint-activations --fp16-adam-stats --max-tokens 12288`"),
                    _nllb("3_3b", *RECIPE, *CKPT, *STATS16, max_tokens=12288)))
    # gradients reduce-scattered in fp16 (--fsdp2-reduce-dtype, issue 40's 2-GPU case)
    rows.append(Row(("3.3B", "`--checkpoint-activations --fp16-adam-stats "
                             "--fsdp2-reduce-dtype fp16`"),
                    _nllb("3_3b", *RECIPE, *CKPT, *STATS16, *REDUCE16)))
    # Adam's moments in 8 bits, then with the fp16 reduction too: what fits two 24 GB GPUs
    rows.append(Row(("3.3B", "`--checkpoint-activations --eight-bit-adam-stats`"),
                    _nllb("3_3b", *RECIPE, *CKPT, *STATS8)))
    rows.append(Row(("3.3B", "`--checkpoint-activations --eight-bit-adam-stats "
                             "--fsdp2-reduce-dtype fp16`"),
                    _nllb("3_3b", *RECIPE, *CKPT, *STATS8, *REDUCE16)))
    return tuple(rows)


def _lora_rows() -> tuple[Row, ...]:
    rows = []
    for label, size in (("600M", "600m"), ("1.3B", "1_3b"), ("3.3B", "3_3b")):
        rows.append(Row((label, "`--lora-rank 16`"), _nllb(size, *RECIPE, *LORA)))
        rows.append(Row((label, "`--lora-rank 16 --checkpoint-activations`"),
                        _nllb(size, *RECIPE, *LORA, *CKPT)))
    return tuple(rows)


TABLES = (
    Table("fitting", "README.md", ("model", "extra flags"), (2, 4, 8), _fitting_rows()),
    Table("one GPU", "docs/memory.md", ("model", "extra flags"), (1,), _one_gpu_rows()),
    Table("one GPU, step in backward", "docs/memory.md", ("NLLB-3.3B, one GPU, settings",),
          (1,), (Row((f"{ONE_GPU_FLAGS} --fsdp2-step-in-backward`",),
                     _nllb_bf16_weights("3_3b", *ONE_GPU, *IN_BACKWARD)),),
          fit_gb=(GPU_24GB_BUDGET, GPU_16GB_BUDGET)),
    Table("lora", "docs/lora.md", ("model", "extra flags"), (1,), _lora_rows()),
    Table("lora fit on 24 GB", "docs/lora.md", ("NLLB-3.3B, one GPU, settings",), (1,), (
        Row(("the recipe's, `--lora-rank 16`",), _nllb("3_3b", *RECIPE, *LORA)),
        Row(("the recipe's, `--lora-rank 16 --checkpoint-activations`",),
            _nllb("3_3b", *RECIPE, *LORA, *CKPT)),
    ), fit_gb=(GPU_24GB_BUDGET,)),
    Table("seed scenario", "docs/memory.md", ("NLLB-600M, settings",), (2,), (
        Row(("NLLB's settings: `--min-params-to-wrap 1e8`, stock criterion, stock tied "
             "gradients, root `default`",), _nllb("600m", *STOCK)),
        Row(("the recipe's: one unit per layer, chunked loss (256 tokens), tied-gradient "
             "buffer, root `always`",), _nllb("600m", *RECIPE)),
        Row(("the recipe's with `--checkpoint-activations`",), _nllb("600m", *RECIPE, *CKPT)),
    )),
    Table("fit on 24 GB", "docs/memory.md", ("NLLB-3.3B, settings",), (2,), (
        Row(("the recipe's, `--checkpoint-activations --eight-bit-adam-stats "
             "--fsdp2-reduce-dtype fp16`",), _nllb("3_3b", *RECIPE, *CKPT, *STATS8, *REDUCE16)),
    ), fit_gb=(GPU_24GB_BUDGET, GPU_16GB_BUDGET)),
)


def predicted_gib(table: Table, row: Row,
                  models: Optional[ModelCache] = None) -> tuple[float, ...]:
    """The estimator's per-GPU peak (largest rank class, GiB) at each world size (``models``:
    the caller's meta models, shared between rows and tables)."""
    return tuple(est.classes[0].peak_gb
                 for est in estimates(parse(table.command(row)), models))


def fitted(table: Table, row: Row, budget: float, claimed: tuple = (),
           models: Optional[ModelCache] = None) -> tuple[str, ...]:
    """Each world size's largest --max-tokens that fits ``budget`` GiB, with its predicted
    peak. ``claimed``: the cells a document holds for them (checked at their edge, fit.py)."""
    claims = {w: _claimed_tokens(cell) for w, cell in zip(table.world_sizes, claimed)}
    fits = largest_max_tokens(parse(table.command(row, budget)), budget, table.world_sizes,
                              {w: t for w, t in claims.items() if t != ()}, models)
    return tuple("none" if fit.max_tokens is None else
                 f"{fit.max_tokens}{'+' if fit.capped else ''} ({fit.peak_gb:.2f} GiB)"
                 for fit in fits)


def _claimed_tokens(cell: str):
    """The --max-tokens a fit cell states ("20480 (20.21 GiB)"; None for "none"); () where the
    cell says no such thing."""
    if cell.strip() == "none":
        return None
    found = re.match(r"\s*(\d+)\+? \(", cell)
    return int(found.group(1)) if found else ()


def documented_cells(block: Optional[str], table: Table) -> dict[tuple, tuple[str, ...]]:
    """A documented block's value cells by row labels (for ``render``'s ``claimed``)."""
    cells = {}
    for line in (block or "").splitlines():
        if line.startswith("| ") and line.endswith(" |"):
            parts = [c.strip() for c in line[2:-2].split(" | ")]
            cells[tuple(parts[:len(table.label_header)])] = tuple(parts[len(table.label_header):])
    return cells


def render(table: Table, claimed: Optional[dict] = None,
           models: Optional[ModelCache] = None) -> str:
    """The block between the markers: the table, then the command of each row. ``claimed``
    (``documented_cells`` of the block in the docs): fit cells checked at their edge rather
    than searched for (the same block when they hold). ``models``: the caller's meta models
    (from_args.ModelCache), each built once for all the tables it renders."""
    gpus = lambda w: f"{w} GPU{'s' if w > 1 else ''}"  # noqa: E731
    if not table.fit_gb:
        header = [*table.label_header, *(gpus(w) for w in table.world_sizes)]
    else:
        header = [*table.label_header, *(f"largest --max-tokens fitting {gb:g} GiB, {gpus(w)}"
                                         for gb in table.fit_gb for w in table.world_sizes)]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * len(table.label_header) + "---:|" * (len(header) -
                                                                 len(table.label_header))]
    commands = []
    for row in table.rows:
        have = (claimed or {}).get(row.labels, ())
        per_budget = len(table.world_sizes)
        values = ([f"{v:.2f}" for v in predicted_gib(table, row, models)] if not table.fit_gb
                  else [cell for i, gb in enumerate(table.fit_gb) for cell in fitted(
                      table, row, gb, tuple(have[i * per_budget:(i + 1) * per_budget]),
                      models)])
        lines.append("| " + " | ".join([*row.labels, *values]) + " |")
        name = ', '.join(label.replace('`', '') for label in row.labels)
        for budget in table.fit_gb or (None,):
            commands.append(f"# {name}\n{ESTIMATE} {shlex.join(table.command(row, budget))}")
    return "\n".join([
        f"<!-- predicted: {table.name} -->", *lines, "",
        "<details><summary>The estimator command of each row</summary>", "", "```bash",
        "\n".join(commands), "```", "", "</details>", END])


def block_pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(f"<!-- predicted: {name} -->") + r".*?" + re.escape(END),
                      re.S)


def documented(text: str, name: str) -> str | None:
    """The block of table ``name`` in a document's text, or None."""
    found = block_pattern(name).search(text)
    return found.group(0) if found else None


def names_in(text: str) -> list[str]:
    """The names of the predicted tables a document holds."""
    return [n for n in re.findall(r"<!-- predicted: (.+?) -->", text) if n != "end"]


def replaced(text: str, table: Table, models: Optional[ModelCache] = None) -> str:
    """``text`` with table's block made anew (the markers must be there; ``models``: as
    ``render``'s)."""
    if documented(text, table.name) is None:
        raise ValueError(f"{table.document} has no '<!-- predicted: {table.name} -->' ... "
                         f"'{END}' block")
    return block_pattern(table.name).sub(lambda _: render(table, models=models), text, count=1)
