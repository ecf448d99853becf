"""pytest plugin of scripts/gpu_check.sh (``-p gpu_check_plugin``): appends to results.jsonl
what was collected, when each test starts and how it ended, as it happens, and rewrites the
report after each test. A run killed from outside, even with SIGKILL, so leaves a report that
is current up to its last finished test and names the test it was in.

GPU_CHECK_WORK (the work folder) and GPU_CHECK_REPORT (the report's path) come from the script.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gpu_report

WORK = Path(os.environ.get("GPU_CHECK_WORK", ".gpu-check"))
REPORT = Path(os.environ.get("GPU_CHECK_REPORT", "gpu_report.md"))
_outcomes: dict[str, dict] = {}


def record(event: dict) -> None:
    with open(WORK / "results.jsonl", "a") as f:
        f.write(json.dumps({**event, "time": time.time()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def rewrite() -> None:
    try:
        gpu_report.write(WORK, REPORT)
    except Exception as e:  # a broken report must not stop the tests; the script rewrites it
        print(f"[gpu_check] the report could not be rewritten: {type(e).__name__}: {e}")


def first_line(report) -> str:
    """The skip reason, or the failure's first ``E`` line (the assertion), shortened."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")[:300]
    text = report.longreprtext or ""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return (errors[0] if errors else (text.strip().splitlines() or [""])[-1])[:300]


def pytest_collection_finish(session) -> None:
    record({"event": "collected", "tests": [item.nodeid for item in session.items]})
    rewrite()


def pytest_runtest_logstart(nodeid, location) -> None:
    record({"event": "start", "test": nodeid})


def pytest_runtest_logreport(report) -> None:
    state = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "note": "",
                                                 "seconds": 0.0})
    state["seconds"] += report.duration
    if report.failed:
        if state["outcome"] != "failed":  # a teardown error after a failure adds nothing
            state["outcome"] = "failed" if report.when == "call" else "error"
            state["note"] = first_line(report)
    elif report.skipped and state["outcome"] == "passed":
        state["outcome"], state["note"] = "skipped", first_line(report)
    if report.when == "teardown":
        record({"event": "result", "test": report.nodeid, **_outcomes.pop(report.nodeid)})
        rewrite()


def pytest_sessionfinish(session, exitstatus) -> None:
    record({"event": "finished", "exit": int(exitstatus)})
