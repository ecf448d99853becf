"""Silence when all is well (process/quiet.py): a training run, a hydra command and plot_memory
print no warning (Python's warnings, "XxxWarning: ...", and logging's, "| WARNING |") and no
debug line under the default warning filters, and the run's filters are the exact ones it
names, gone again after the run; the run says each of its messages once.

The processes run as fresh interpreters without PYTHONWARNINGS, whatever the suite's
environment holds: forked from the test server, they would have its filters, which come from
the suite's environment (with PYTHONWARNINGS=ignore there, the runs would prove nothing).
"""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

from conftest import REPO
from launcher import ok, run_ranks, said_twice, train_inner

from fairseq_fsdp2.process import quiet

#: a Python warning as printed ("...: UserWarning: ..."), a logging warning as fairseq's format
#: writes it ("2026-12-05 15:00:00 | WARNING | name | ...") and as hydra's job logging does
#: ("[2026-12-05 15:00:00,123][name][WARNING] - ...")
WARNING_LINE = re.compile(r"^.*(\b\w*Warning: |\| WARNING \||\]\[WARNING\] - ).*$", re.M)
#: the default warning filters: the variable empty is the variable unset (Python's _Py_GetEnv)
DEFAULT_FILTERS = {"PYTHONWARNINGS": ""}


@pytest.fixture(scope="module")
def run_output(corpus, tmp_path_factory) -> str:
    """Two ranks, FSDP2, a unit per layer, the chunked loss (the shared-embedding unit's
    outputs too), root resharded: every unit kind whose outputs FSDP2 warns about, and the
    collectives only several ranks run (the tied embedding's early reduce)."""
    from conftest import train_args_for
    save = tmp_path_factory.mktemp("quiet") / "ckpt"
    args = train_args_for(corpus, save, "--ddp-backend", "fsdp2", "--min-params-to-wrap", "1",
                          "--fsdp2-root-reshard", "always", "--loss-chunk-tokens", "64",
                          save=True, updates=2)
    args[args.index("label_smoothed_cross_entropy")] = "label_smoothed_cross_entropy_chunked"
    output = ok(run_ranks(2, lambda rank: args, fresh_interpreter=True, env=DEFAULT_FILTERS))
    assert len(train_inner(output)) == 2, output[-3000:]
    return output


def test_a_run_prints_no_hydra_deprecation(run_output):
    # fairseq-train's config conversion: patch 9 (registration.py)
    assert "hydra" not in run_output.lower(), run_output[:3000]


def test_a_run_prints_no_warning(run_output):
    shown = [m.group(0) for m in WARNING_LINE.finditer(run_output)]
    assert not shown, shown


def test_a_run_says_each_message_once(run_output):
    assert not said_twice(run_output), said_twice(run_output)


def test_the_run_filters_are_exact_and_removed_after():
    view = ("FSDP2-wrapped module (FSDPTransformerDecoderLayerBase) returned a view tensor. "
            "An in-place op on this view ...")
    torch_module = "torch.distributed.fsdp._fully_shard._fsdp_state"

    def shown(message, module, silenced: bool) -> bool:
        """Whether the warning reaches the user: every warning shown, except through the run's
        filters when they are installed (independent of the filters pytest runs under)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            warnings.simplefilter("always")
            if silenced:
                quiet.install()
            warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module, registry={})
        return bool(caught)

    assert shown(view, torch_module, silenced=False)
    assert not shown(view, torch_module, silenced=True)
    assert shown(view, "someone.else", silenced=True)  # the same words from another module
    assert shown(view.replace("FSDPTransformerDecoderLayerBase", "FSDPMyLayer"), torch_module,
                 silenced=True)  # a unit whose outputs were not examined
    before = list(warnings.filters)
    with quiet.silenced():
        assert len(warnings.filters) == len(before) + len(quiet.RUN_WARNINGS)
    assert warnings.filters == before  # exactly what it added is gone, nothing else


#: the commands' probe (tests/probes/quiet_commands.py) and what it prints after each command
PROBES = str(REPO / "tests" / "probes")
MARK = re.compile(r"^=== quiet_commands: (\S+) exit (-?\d+) ===$", re.M)


@pytest.fixture(scope="module")
def commands(corpus, tmp_path_factory) -> tuple[dict, str, Path]:
    """plot_memory, then the hydra command, as ``python -m`` runs them, one after the other in
    ONE fresh interpreter (not forked from the test server, whose logging has no root handler:
    a debug line would not show there; one interpreter's imports instead of two): the probe
    puts logging and the warning filters back, before each, as they are once the package is
    imported, so what one command set cannot hide the other's lines. Each command's output
    (a dict by module), the whole output (import-time warnings of modules both use are printed
    in the first one's part) and the chart's folder."""
    tmp = tmp_path_factory.mktemp("quiet-commands")
    log = tmp / "memory.jsonl"
    log.write_text('{"num_updates": 2, "device": "cpu", "ranks": [{"rank": 0, "peak_gb": 1.0, '
                   '"reserved_gb": 0.0, "alloc_retries": 0.0}]}\n')
    # fairseq's hydra main composes the whole config (deprecations at its import and compose,
    # hydra's debug lines under fairseq's DEBUG root); --cfg job prints it and stops
    argv = ["fairseq_fsdp2.plot_memory", log, tmp / "memory.png", "::",
            "fairseq_fsdp2.hydra_train", "--config-dir", REPO / "configs",
            "--config-name", "nllb_tiny_demo", f"task.data={corpus}", "--cfg", "job"]
    (result,) = run_ranks(1, lambda rank: [str(a) for a in argv], module="quiet_commands",
                          fresh_interpreter=True, torchrun_env=False, timeout=180,
                          env={**DEFAULT_FILTERS, "PYTHONPATH": os.pathsep.join(
                              [PROBES, os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.output[-3000:]
    output, parts, start = result.output, {}, 0
    for m in MARK.finditer(output):
        assert m[2] == "0", output[start:m.start()][-3000:]
        parts[m[1]] = output[start:m.start()]
        start = m.end()
    assert list(parts) == ["fairseq_fsdp2.plot_memory", "fairseq_fsdp2.hydra_train"], output[-3000:]
    return parts, output, tmp


def test_hydra_command_prints_no_deprecation_and_no_debug(commands):
    parts, output, _ = commands
    assert "max_update: 300" in parts["fairseq_fsdp2.hydra_train"]  # composed and printed
    # the whole output: fairseq's and the plugin's imports ran in the first command's part
    assert not WARNING_LINE.search(output), output[:3000]
    assert "DEBUG" not in output, output[:3000]


def test_plot_memory_prints_no_debug(commands):
    parts, _, tmp = commands
    output = parts["fairseq_fsdp2.plot_memory"]
    assert (tmp / "memory.png").is_file()
    assert "DEBUG" not in output and "matplotlib" not in output, output[:3000]
