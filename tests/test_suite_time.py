"""scripts/benchmark_suite.py's reading of a suite run (benchmarks/suite_time.py): pytest's
summary line and --durations lines as pytest 8 prints them, which runs count as passing (only
those are written to docs/benchmarks.md), and the report. The run itself is the whole suite
(minutes): it is not run here."""
import subprocess
import sys

from conftest import REPO

from benchmarks.suite_time import (BEGIN, END, TOP_FILES, passing_result, report,
                                   seconds_per_file, summary)

#: the end of a real `scripts/test.sh --durations=0` output (pytest 8, -q, two workers)
OUTPUT = """\
........................................................................ [ 95%]
17.72s call     tests/test_nllb_finetune.py::test_two_rank_cpu_finetune_and_stock_generate
5.90s setup    tests/test_backend.py::test_fp16_equals_stock_fp16
4.10s call     tests/test_backend.py::test_fp16_equals_stock_fp16
0.50s teardown tests/test_backend.py::test_fp16_equals_stock_fp16
2.25s call     tests/test_plan.py::test_a_plan[case::with colons]

(1324 durations < 0.005s hidden.  Use -vv to show these durations.)
603 passed, 40 skipped, 102 warnings in 353.12s (0:05:53)
"""


def test_summary_reads_the_counts_and_pytests_seconds():
    assert summary(OUTPUT) == ({"passed": 603, "skipped": 40, "warnings": 102}, 353.12)
    # without -q pytest frames it in '='
    framed = "===== 2 failed, 601 passed, 1 error in 360.50s (0:06:00) ====="
    assert summary(framed) == ({"failed": 2, "passed": 601, "error": 1}, 360.5)
    assert summary("collected 0 items\n") is None


def test_only_a_run_that_exited_0_with_no_failure_counts_as_passing():
    assert passing_result(0, OUTPUT) == summary(OUTPUT)
    assert passing_result(1, OUTPUT) is None  # pytest's own verdict wins
    failed = OUTPUT.replace("603 passed", "1 failed, 602 passed")
    assert passing_result(0, failed) is None
    erred = OUTPUT.replace("603 passed", "603 passed, 2 errors")
    assert passing_result(0, erred) is None
    assert passing_result(0, "40 skipped in 3.00s") is None  # nothing ran
    assert passing_result(0, "killed\n") is None  # no summary line


def test_durations_are_summed_per_file_longest_first():
    per_file = seconds_per_file(OUTPUT)
    assert list(per_file) == ["tests/test_nllb_finetune.py", "tests/test_backend.py",
                              "tests/test_plan.py"]
    assert per_file["tests/test_backend.py"] == 5.90 + 4.10 + 0.50  # setup, call, teardown
    assert per_file["tests/test_plan.py"] == 2.25  # a test id with '::' inside its parameter


def test_the_report_is_one_section_with_the_figures_and_the_longest_files():
    files = {f"tests/test_{i}.py": 100.0 - i for i in range(TOP_FILES + 3)}
    counts, seconds = summary(OUTPUT)
    text = report({"wall": 371.0, "cpu": 655.4}, counts, seconds, files,
                  {"cpu": "AMD EPYC", "cores": 2, "python": "3.11.7", "torch": "2.13.0+cpu",
                   "fairseq": "0.12.3.1"},
                  {"command": ".venv/bin/python scripts/benchmark_suite.py --imitate-avx2",
                   "date": "2026-12-06", "load": 0.1, "imitate_avx2": True})
    assert text.startswith(BEGIN) and text.endswith(END)
    assert "| pytest's time (its summary line) | 353 s |" in text
    assert "| 655 s |" in text and "| the whole command, wall | 371 s |" in text
    assert "603 passed, 40 skipped, 102 warnings" in text
    assert "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" in text
    listed = [f for f in files if f"| {f} |" in text]
    assert listed == list(files)[:TOP_FILES]


def test_an_output_that_cannot_be_written_stops_before_the_run(tmp_path):
    """One line and exit 2 before the suite's minutes, and nothing written."""
    for flag, path in (("--out", tmp_path / "missing" / "benchmarks.md"),
                       ("--log", tmp_path / "missing" / "suite.log")):
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_suite.py"),
                               flag, str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert proc.stderr.splitlines()[-1].endswith(f"{flag} {path}: cannot write there")
        assert not (tmp_path / "missing").exists()
