"""Every number a user reads can be traced to the command that made it.

Predicted tables (README.md, docs/): each is what the estimator prints today for the commands
recorded beside it (fairseq_fsdp2/estimator/doc_tables.py; scripts/predicted_tables.py writes
them). Cheap: the estimator builds the NLLB models on the meta device.

Measured tables (docs/benchmarks.md): each section names its command and date, and a command
of a benchmark script is still one its argument parser accepts (nothing is run or timed)."""
from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from conftest import REPO
from fairseq_fsdp2 import estimate as cli
from fairseq_fsdp2.estimator import from_args
from fairseq_fsdp2.estimator.doc_tables import (CKPT, GPU_16GB_BUDGET, GPU_24GB_BUDGET, NLLB_GPU,
                                                RECIPE, REDUCE16, STATS8, STATS16, TABLES,
                                                documented, documented_cells, names_in, render,
                                                replaced)
from fairseq_fsdp2.estimator.ledger import Setup, step_temporary_bytes
from fairseq_fsdp2.models.nllb import NLLB_SIZES

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Options the estimate reads only in its Setup (from_args.setup_for: the optimizer's state and
#: step, the reduction, offloading, the tied embedding's early reduce, the ranks), never in the
#: model's profile (from_args.profile_for: the model built on the meta device, its sharding plan
#: and its traced forward, which estimates() already makes once for every --world-size).
SETUP_ONLY = {"world_size", "fit_gb", "cpu_baseline_gb", "fp16_adam_stats", "bf16_adam_stats",
              "eight_bit_adam_stats", "fsdp2_reduce_dtype", "cpu_offload",
              "fsdp2_no_tied_early_reduce", "fsdp2_step_in_backward"}


@pytest.fixture(scope="module")
def models():
    """The meta models and profiles of this module's estimates, each made once, as one run of
    scripts/predicted_tables.py makes them (from_args.ModelCache); dropped after the module.
    Here a meta model is also shared between command lines equal but for SETUP_ONLY (0.1 s a
    build of NLLB-3.3B's: the recipe's rows differ in optimizer and reduction settings only),
    as one_profile_per_model_and_workload shares their profiles, and safe for the same reason:
    the documents' figures come from models built for each command line, so a SETUP_ONLY
    option that came to change a model would fail here (a table that differs)."""
    cache, built = from_args.ModelCache(), {}
    real = cache.model

    def model(args):
        key = repr(sorted((k, v) for k, v in vars(args).items()
                          if k not in SETUP_ONLY and k not in from_args.NOT_BUILT_FROM))
        if key not in built:
            before = dict(vars(args))
            made = real(args)  # names what its build set on args (the languages)
            built[key] = made, {k: v for k, v in vars(args).items()
                                if k not in before or before[k] != v}
        made, named = built[key]
        vars(args).update(named)
        return made
    cache.model = model  # ModelCache.profile asks self.model
    return cache


@pytest.fixture(scope="module", autouse=True)
def one_profile_per_model_and_workload():
    """The tables and the prose estimate NLLB-3.3B with the recipe's settings under many
    optimizer and reduction settings; each profile (most of an estimate's time) is made once
    here for every command line equal but for SETUP_ONLY, as estimates() shares one between
    world sizes. Only this module's figures are made so: the documents come from
    scripts/predicted_tables.py, which shares a profile only between command lines equal but
    for from_args.NOT_PROFILED (the ranks, the device, the budget), so a SETUP_ONLY option that
    came to change a profile would fail here (a table that differs), never pass unseen (tried:
    checkpoint_activations in SETUP_ONLY fails the 'fitting' table)."""
    real, made = from_args.profile_for, {}

    def profile_for(args, model=None):
        assert SETUP_ONLY <= set(vars(args)), SETUP_ONLY - set(vars(args))  # one renamed
        key = repr(sorted((k, v) for k, v in vars(args).items() if k not in SETUP_ONLY))
        if key not in made:
            made[key] = real(args, model)
        return made[key]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(from_args, "profile_for", profile_for)
        yield


@pytest.fixture(scope="module")
def rendered() -> dict:
    """Each table of peaks as the test below rendered it (by name): render's ``claimed`` only
    reaches a fit table's cells, so a table of peaks renders the same block without it, and
    test_a_changed_figure_or_command_is_caught compares with this one rather than rendering the
    table three times more (0.1-0.3 s each, its profiles made)."""
    return {}


def render_peaks(table, models, rendered: dict) -> str:
    """``table`` (of peaks) rendered, once per module."""
    assert not table.fit_gb
    if table.name not in rendered:
        rendered[table.name] = render(table, models=models)
    return rendered[table.name]


@pytest.mark.parametrize("table", TABLES, ids=[t.name for t in TABLES])
def test_each_predicted_table_is_what_the_estimator_prints_for_its_commands(table, models,
                                                                            rendered):
    text = (REPO / table.document).read_text()
    block = documented(text, table.name)
    assert block is not None, f"{table.document} lost its '{table.name}' table"
    # a fit table's documented --max-tokens are checked at their edge (fit.py), not searched
    fresh = (render(table, documented_cells(block, table), models) if table.fit_gb
             else render_peaks(table, models, rendered))
    assert block == fresh, \
        f"{table.document}: the '{table.name}' table is stale; run scripts/predicted_tables.py"


def test_no_predicted_table_in_the_docs_is_left_out_of_the_generator():
    known = {(t.document, t.name) for t in TABLES}
    found = {(str(path.relative_to(REPO)), name) for path in DOCUMENTS
             for name in names_in(path.read_text())}
    assert found == known


def test_a_changed_figure_or_command_is_caught(models, rendered):
    """The comparison above sees one figure or one recorded command changed."""
    table = next(t for t in TABLES if not t.fit_gb)  # a table of peaks
    fresh = replaced(f"x\n<!-- predicted: {table.name} -->\n<!-- predicted: end -->\ny\n", table,
                     models)
    block = documented(fresh, table.name)
    want = render_peaks(table, models, rendered)  # what the test above compares with
    assert block == want and fresh.startswith("x\n") and fresh.endswith("\ny\n")
    figure = re.search(r"\| (\d+\.\d\d) \|", block).group(1)
    assert block.replace(f"| {figure} |", "| 0.01 |", 1) != want

    assert block.replace("--max-tokens 4096", "--max-tokens 2048", 1) != want


def benchmark_sections() -> dict[str, str]:
    """Section title -> text; the page's opening (scripts/benchmark.py's command) goes with the
    first section, whose table that script writes."""
    text = (REPO / "docs" / "benchmarks.md").read_text()
    opening, *parts = re.split(r"^## ", text, flags=re.M)
    parts[0] = parts[0] + opening
    return {part.splitlines()[0]: part for part in parts}


def test_every_measured_section_names_its_command_and_date():
    sections = benchmark_sections()
    measured = {name: body for name, body in sections.items() if name != "Reading the numbers"}
    assert measured
    for name, body in measured.items():
        assert re.search(r"Command:", body), f"benchmarks.md '{name}' names no command"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", body), f"benchmarks.md '{name}' has no date"


def test_recorded_benchmark_commands_still_parse():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    commands = re.findall(r"Command:\s+`\.venv/bin/python (scripts/\w+\.py)([^`]*)`", text)
    scripts = {script for script, _ in commands}
    assert scripts >= {"scripts/benchmark.py", "scripts/benchmark_loss.py",
                       "scripts/benchmark_nllb600m.py", "scripts/benchmark_optimizer_step.py"}
    for script, args in commands:
        spec = importlib.util.spec_from_file_location(f"recorded_{script[8:-3]}", REPO / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # defines functions; runs nothing (a __main__ guard)
        module.build_parser().parse_args(shlex.split(args))  # SystemExit(2) if it fails


# -- figures in prose (docs/memory.md, "NLLB-3.3B on two 24 GB GPUs without --cpu-offload") ----

def nllb_3_3b(models, *flags: str, max_tokens: int = 4096):
    """The estimate for NLLB-3.3B with the recipe's settings, ``flags`` and ``max_tokens`` per
    GPU, at 2 GPUs (the prose's setting): its one class of ranks (its profile made once, in
    ``models``, for both pages' prose)."""
    argv = [str(max_tokens) if before == "--max-tokens" else arg
            for before, arg in zip(("",) + NLLB_GPU, NLLB_GPU)]
    (estimate,) = cli.estimate_args([*argv, "--arch", "transformer_nllb_3_3b", *RECIPE, *flags,
                                     "--world-size", "2"], models)
    (ranks,) = estimate.classes
    return ranks


def prose_claims(models) -> list[str]:
    """Each figure of the section's prose, in the phrase that states it, computed from the
    estimator (and the tied embedding's size, for the parts of a category it names)."""
    gib = lambda n: n / 2 ** 30  # noqa: E731
    stats16 = nllb_3_3b(models, *CKPT, *STATS16)
    at_12288, at_13312 = (nllb_3_3b(models, *CKPT, *STATS16, max_tokens=t)
                          for t in (12288, 13312))
    reduce16 = nllb_3_3b(models, *CKPT, *STATS16, *REDUCE16)
    stats8 = nllb_3_3b(models, *CKPT, *STATS8)
    both = nllb_3_3b(models, *CKPT, *STATS8, *REDUCE16)
    both_2048 = nllb_3_3b(models, *CKPT, *STATS8, *REDUCE16, max_tokens=2048)
    no_early = nllb_3_3b(models, *CKPT, *STATS8, *REDUCE16, "--fsdp2-no-tied-early-reduce")
    b, b8, bb = stats16.breakdown, stats8.breakdown, both.breakdown
    embedding = 256206 * NLLB_SIZES["transformer_nllb_3_3b"]["dim"]  # elements, tied
    fp16_grad = gib(embedding * 2)
    assert stats16.moment == reduce16.moment == "optimizer step"
    assert "decoder.layers" in at_12288.moment and "decoder.layers" in at_13312.moment
    assert both.moment == both_2048.moment == "backward: encoder.layers.1"
    assert "reduce-scatter shared" in no_early.moment
    # the optimizer step's temporaries: one chunk's (the 16-bit gradients kept, 8-bit moments)
    temporaries = step_temporary_bytes(Setup(optimizer="adam", adam_stats="8bit",
                                             narrow_grads=True), embedding // 2, 10 ** 10)
    held = gib(bb["sharded"]) * 1.5 + gib(bb["optim"])  # fp32 weights, fp16 grads, state
    return [
        f"on 2 GPUs is {stats16.peak_gb:.2f} GiB at 4,096 tokens",
        f"fp32 parameter shards {gib(b['sharded']):.2f} GiB, their fp32 gradients "
        f"{gib(b['grads']):.2f}, 16-bit Adam state with the step's temporaries "
        f"{gib(b['optim']):.2f}",
        f"a decoder layer's recomputation: {at_12288.peak_gb:.2f} GiB at 12,288 tokens, "
        f"{at_13312.peak_gb:.2f} at 13,312",
        f"that is {stats16.peak_gb + 1:.1f}-{stats16.peak_gb + 2:.1f} GiB",
        f"stays {reduce16.peak_gb:.2f} GiB at 4,096 tokens",
        f"{stats8.peak_gb:.2f} GiB (state {gib(b8['optim']):.2f} GiB instead of "
        f"{gib(at_12288.breakdown['optim']):.2f})",
        f"the prediction is {both.peak_gb:.2f} GiB at 4,096 tokens per GPU ("
        f"{both_2048.peak_gb:.2f} at 2,048)",
        f"fp32 parameter shards {gib(bb['sharded']):.2f} GiB, gradients {gib(bb['grads']):.2f} "
        f"(the fp16 shards reduced so far, the tied embedding's among them, and the looked-up "
        f"rows), the 8-bit state {gib(bb['optim']):.2f}, activations {gib(bb['acts']):.2f}",
        f"holds the fp32 parameter shards {gib(bb['sharded']):.2f} GiB, the fp16 gradient shards "
        f"{gib(bb['sharded']) / 2:.2f}, the 8-bit state {gib(bb['optim']):.2f} and one chunk's "
        f"temporaries {gib(temporaries):.2f}",
        f"that is {both.peak_gb + 1:.1f}-{both.peak_gb + 2:.1f} GiB",
        f"every rank holds {held:.2f} GiB of shards and state",
        f"in fp16 unsharded ({fp16_grad:.2f} GiB), as FSDP2's copy of it into the reduce-scatter's "
        f"input ({gib(no_early.breakdown['comm']):.2f}) and as this rank's reduced half, and the "
        f"peak is {no_early.peak_gb:.2f} GiB",
        # bf16 weights: half the fp32 shards and half their fp32 gradients (as many bytes)
        f"about {gib(b['sharded']):.2f} GiB at that peak on 2 GPUs ({gib(b['sharded']) / 2:.2f} "
        f"parameters, {gib(b['sharded']) / 2:.2f} gradients)",
    ]


def test_memory_prose_figures_are_what_the_estimator_predicts(models):
    """docs/memory.md's figures outside the generated tables: each phrase, with the figure the
    estimator gives today, is in the page (a figure that went stale fails here)."""
    text = " ".join((REPO / "docs" / "memory.md").read_text().split())
    missing = [claim for claim in prose_claims(models) if claim not in text]
    assert not missing, "docs/memory.md states otherwise (expected phrases):\n" + "\n".join(missing)


def one_gpu_in_backward_claims(models) -> list[str]:
    """docs/memory.md's "NLLB on one GPU" prose on the step in backward: why NLLB-3.3B fits no
    16 GB GPU, from the estimate of its one-GPU row (the table's own command): the bf16
    weights and 8-bit moments alone, and what the peak (the end of backward) adds to them."""
    table = next(t for t in TABLES if t.name == "one GPU")
    row = next(r for r in table.rows if "--fsdp2-step-in-backward" in r.argv)
    (estimate,) = cli.estimate_args(table.command(row), models)
    (ranks,) = estimate.classes
    b, gib = ranks.breakdown, (lambda n: n / 2 ** 30)  # noqa: E731
    assert "reduce-scatter shared" in ranks.moment
    held = gib(b["sharded"] + b["optim"])
    assert held + gib(b["grads"] + b["comm"]) > GPU_16GB_BUDGET  # "does not fit"
    return [f"the bf16 weights and 8-bit moments alone take {held:.1f} GiB",
            f"take {gib(b['grads'] + b['comm']):.2f} GiB more"]


def test_one_gpu_step_in_backward_prose_is_what_the_estimator_predicts(models):
    text = " ".join((REPO / "docs" / "memory.md").read_text().split())
    missing = [claim for claim in one_gpu_in_backward_claims(models) if claim not in text]
    assert not missing, "docs/memory.md states otherwise (expected phrases):\n" + "\n".join(missing)


def readme_prose_claims(models) -> list[str]:
    """The figures of README's prose under its "Fitting NLLB on your GPUs" table (NLLB-3.3B on
    two 24 GB GPUs), each in the phrase that states it, from the estimates docs/memory.md's
    prose uses (nllb_3_3b: made once), and the fits they claim against the budgets the tables
    use (doc_tables.GPU_24GB_BUDGET, GPU_16GB_BUDGET)."""
    gib = lambda n: n / 2 ** 30  # noqa: E731
    stats16 = nllb_3_3b(models, *CKPT, *STATS16)
    both = nllb_3_3b(models, *CKPT, *STATS8, *REDUCE16)
    # the parameters: the estimate's fp32 parameter shards, 4 bytes an element on each of 2
    # GPUs; with their fp32 gradients and Adam's two fp32 moments 16 bytes an element
    params = stats16.breakdown["sharded"] * 2 / 4
    whole = gib(params * 16 / 2)
    assert stats16.peak_gb > GPU_24GB_BUDGET  # "does not fit ... at the edge"
    assert both.peak_gb <= GPU_16GB_BUDGET  # "which fits" two 16 GB GPUs (and 24 GB ones)
    return [
        f"parameters, gradients and Adam state are {params / 1e6:,.0f}M x 16 bytes / 2 = "
        f"{whole:.1f} GiB per GPU before any activation",
        f"the predicted peak is {stats16.peak_gb:.2f} GiB: with the CUDA context at the edge of "
        f"{24e9 / 2 ** 30:.1f} GiB",
        f"the prediction is {both.peak_gb:.2f} GiB at 4,096 tokens per GPU, **which fits** two "
        f"24 GB GPUs and, up to 4,096 tokens per GPU, two 16 GB GPUs ({GPU_16GB_BUDGET:.1f} GiB "
        f"for tensors;",
        f"those states live in host memory (about {whole:.0f} GiB of RAM per rank)",
    ]


def test_readme_prose_figures_are_what_the_estimator_predicts(models):
    """README's figures outside its generated tables, as docs/memory.md's above."""
    text = " ".join((REPO / "README.md").read_text().split())
    missing = [claim for claim in readme_prose_claims(models) if claim not in text]
    assert not missing, "README.md states otherwise (expected phrases):\n" + "\n".join(missing)
