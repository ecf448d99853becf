"""Writes gpu_report.md for scripts/gpu_check.sh: the machine (GPU, driver, versions), each cuda
test's result and the estimator-versus-measured table the estimator tests recorded."""
from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

RESULT = re.compile(r"^(tests/\S+::\S+(?:\[[^\]]*\])?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def machine() -> list[str]:
    import torch
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):  # a torch without NCCL (GPU_CHECK_ALLOW_CPU)
        nccl = "none"
    rows = [f"- Python {platform.python_version()}, torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}, NCCL {nccl})"]
    try:
        import fairseq
        rows.append(f"- fairseq {fairseq.__version__}")
    except Exception as e:  # the report still says what went wrong
        rows.append(f"- fairseq: not importable ({e})")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        smi = []
    rows += [f"- GPU {line}" for line in smi] or [
        f"- GPU {i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    return rows


def results(log: Path, junit: Path) -> list[tuple[str, str, str]]:
    """(test, outcome, first line of the failure or skip reason), from pytest -v's lines (there
    even when the run was stopped by its timeout) and, when written, the JUnit file."""
    found: dict[str, list[str]] = {}
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = RESULT.match(line)
        if m:
            found[m.group(1)] = [m.group(2), ""]
    if junit.exists():
        for case in ElementTree.parse(junit).iter("testcase"):
            name = f"{case.get('file') or 'tests/test_cuda.py'}::{case.get('name')}"
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None and name in found:
                    found[name][1] = (node.get("message") or "").strip().splitlines()[0][:200] \
                        if (node.get("message") or "").strip() else ""
    return [(name, *v) for name, v in found.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True, help="scripts/gpu_check.sh's work folder")
    parser.add_argument("--build-seconds", type=int, required=True)
    parser.add_argument("--test-seconds", type=int, required=True)
    parser.add_argument("--pytest-status", type=int, required=True)
    args = parser.parse_args()
    work = Path(args.dir)
    rows = results(work / "pytest.log", work / "junit.xml")
    counts = {k: sum(1 for r in rows if r[1] == k) for k in ("PASSED", "FAILED", "ERROR",
                                                            "SKIPPED")}
    lines = ["# GPU check (scripts/gpu_check.sh)", "", *machine(), "",
             f"Environment built in {args.build_seconds} s; cuda tests ran {args.test_seconds} s "
             f"(pytest exit status {args.pytest_status}"
             + (", stopped by the time limit" if args.pytest_status == 124 else "") + "): "
             + ", ".join(f"{v} {k.lower()}" for k, v in counts.items() if v) + ".", "",
             "## Tests", "", "| test | result | note |", "|---|---|---|"]
    lines += [f"| `{name.split('::', 1)[1]}` | {outcome} | {note.replace('|', '/')} |"
              for name, outcome, note in rows] or [
        "| (no test result: pytest did not run them, see .gpu-check/pytest.log) | | |"]
    table = work / "estimates.jsonl"
    lines += ["", "## Estimator (`--device cuda`) against the measured allocator peak", "",
              "One GPU, FSDP2 per-layer plan, root reshard always, fp32 Adam; measured: the "
              "largest per-interval `mem_peak_gb_max` of updates 2-3.", "",
              "| config | measured GiB | predicted GiB | error | predicted peak at |",
              "|---|---:|---:|---:|---|"]
    for line in table.read_text().splitlines() if table.exists() else []:
        r = json.loads(line)
        lines.append(f"| {r['name']} | {r['measured_gib']:.3f} | {r['predicted_gib']:.3f} | "
                     f"{r['error'] * 100:+.1f}% | {r['peak_at']} |")
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
