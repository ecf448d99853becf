"""The test suite's time: ``scripts/test.sh`` (the README's test command) run once, as CI runs it,
with pytest's ``--durations=0``; reports pytest's own time (its summary line: the budget's
figure), the CPU time of every process the suite started, its result, and the files that take
longest. ``imitate_avx2`` runs it as on a CPU without AVX-512 (the project's slowest CPUs, AMD
EPYC Zen 1): ATen's AVX2 kernels and oneDNN's AVX2 GEMMs (bf16 matmuls then run a reference
GEMM), both set, as no CPU has one without the other."""
from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

from benchmarks.harness import ROOT, replace_section, versions

BEGIN, END = "<!-- suite-time: begin -->", "<!-- suite-time: end -->"
#: what a CPU without AVX-512 runs (ATen's kernels and oneDNN's GEMMs alike)
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: the files named in the report, longest first
TOP_FILES = 10

# pytest -q's last line: "603 passed, 40 skipped, 102 warnings in 353.12s (0:05:53)"
SUMMARY = re.compile(r"^(?P<counts>\d+ \w+(?:, \d+ \w+)*) in (?P<seconds>[\d.]+)s\b")
# one line of --durations: "12.34s call     tests/test_x.py::test_y[case]"
DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?:setup|call|teardown) +(?P<file>[^:\s]+)::")


def summary(output: str) -> Optional[tuple[dict[str, int], float]]:
    """pytest's summary line in ``output``: ({outcome: count}, seconds); None without one."""
    for line in reversed(output.splitlines()):
        found = SUMMARY.match(line.strip().strip("=").strip())
        if found:
            counts = {}
            for part in found["counts"].split(", "):
                number, outcome = part.split(" ", 1)
                counts[outcome] = int(number)
            return counts, float(found["seconds"])
    return None


def passing_result(returncode: int, output: str) -> Optional[tuple[dict[str, int], float]]:
    """summary(output) for a suite that ran and passed (exit status 0, tests passed, none
    failed or erred); None otherwise."""
    found = summary(output)
    if returncode != 0 or found is None:
        return None
    counts = found[0]
    if not counts.get("passed") or any(counts.get(k) for k in ("failed", "error", "errors")):
        return None
    return found


def seconds_per_file(output: str) -> dict[str, float]:
    """``--durations=0``'s lines summed per test file (setup, call and teardown), longest first."""
    per_file: dict[str, float] = defaultdict(float)
    for line in output.splitlines():
        found = DURATION.match(line.strip())
        if found:
            per_file[found["file"]] += float(found["seconds"])
    return dict(sorted(per_file.items(), key=lambda kv: -kv[1]))


def run_suite(pytest_args: list[str], imitate_avx2: bool, log: Path) -> dict:
    """Run scripts/test.sh once (its output to ``log``); its wall and CPU seconds. CPU: every
    process the suite started and waited for (RUSAGE_CHILDREN), setup and compilation included."""
    env = dict(os.environ, **(AVX2_ONLY if imitate_avx2 else {}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), "--durations=0",
                               *pytest_args], cwd=ROOT, env=env, stdout=out,
                              stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"returncode": proc.returncode, "wall": wall, "cpu": cpu}


def report(run: dict, counts: dict[str, int], pytest_seconds: float, per_file: dict,
           info: dict, meta: dict) -> str:
    imitated = (", with `" + " ".join(f"{k}={v}" for k, v in AVX2_ONLY.items()) + "` set (what "
                "a CPU without AVX-512 runs)") if meta["imitate_avx2"] else ""
    lines = [BEGIN, "## The test suite's time", "",
             f"Command: `{meta['command']}` ({meta['date']}): `scripts/test.sh` once, as CI runs "
             f"it{imitated}. Machine: {info['cpu']}, {info['cores']} cores; Python "
             f"{info['python']}, torch {info['torch']}, fairseq-fixed {info['fairseq']}; load "
             f"average {meta['load']:.1f} before. The budget is 15 minutes of pytest on 2 cores "
             "of the slowest CPU the project supports (an AMD EPYC Zen 1, AVX2 only).", "",
             "| | |", "|---|---:|",
             f"| pytest's time (its summary line) | {pytest_seconds:.0f} s |",
             f"| CPU time of every process the command started (user + system; setup and "
             f"compilation included) | {run['cpu']:.0f} s |",
             f"| the whole command, wall | {run['wall']:.0f} s |",
             "| result | " + ", ".join(f"{n} {k}" for k, n in counts.items()) + " |", "",
             f"The {TOP_FILES} longest files (pytest's `--durations`, summed per file; the two "
             "workers run files side by side, so these add up to more than pytest's time):", "",
             "| file | seconds |", "|---|---:|"]
    lines += [f"| {name} | {s:.1f} |" for name, s in list(per_file.items())[:TOP_FILES]]
    return "\n".join(lines + ["", END])


def main(pytest_args: list[str], imitate_avx2: bool, out: Path, log: Path,
         command_line: str) -> int:
    """Measure, then replace the section of ``out``; a suite that did not pass writes nothing
    there (one line, exit 1)."""
    load = os.getloadavg()[0]
    run = run_suite(pytest_args, imitate_avx2, log)
    output = log.read_text(errors="replace")
    found = passing_result(run["returncode"], output)
    if found is None:
        print(f"benchmark_suite: the suite did not pass (exit status {run['returncode']}; "
              f"output in {log}): {out} left as it was", file=sys.stderr)
        return 1
    counts, pytest_seconds = found
    meta = {"command": command_line, "date": time.strftime("%Y-%m-%d"), "load": load,
            "imitate_avx2": imitate_avx2}
    text = report(run, counts, pytest_seconds, seconds_per_file(output), versions(), meta)
    replace_section(out, BEGIN, END, text)
    print(text)
    return 0
