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
from fairseq_fsdp2.estimator.doc_tables import TABLES, documented, names_in, render, replaced

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("table", TABLES, ids=[t.name for t in TABLES])
def test_each_predicted_table_is_what_the_estimator_prints_for_its_commands(table):
    text = (REPO / table.document).read_text()
    block = documented(text, table.name)
    assert block is not None, f"{table.document} lost its '{table.name}' table"
    assert block == render(table), \
        f"{table.document}: the '{table.name}' table is stale; run scripts/predicted_tables.py"


def test_no_predicted_table_in_the_docs_is_left_out_of_the_generator():
    known = {(t.document, t.name) for t in TABLES}
    found = {(str(path.relative_to(REPO)), name) for path in DOCUMENTS
             for name in names_in(path.read_text())}
    assert found == known


def test_a_changed_figure_or_command_is_caught():
    """The comparison above sees one figure or one recorded command changed."""
    table = next(t for t in TABLES if t.fit_gb is None)  # a table of peaks
    fresh = replaced(f"x\n<!-- predicted: {table.name} -->\n<!-- predicted: end -->\ny\n", table)
    block = documented(fresh, table.name)
    assert block == render(table) and fresh.startswith("x\n") and fresh.endswith("\ny\n")
    figure = re.search(r"\| (\d+\.\d\d) \|", block).group(1)
    assert block.replace(f"| {figure} |", "| 0.01 |", 1) != render(table)
    assert block.replace("--max-tokens 4096", "--max-tokens 2048", 1) != render(table)


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
