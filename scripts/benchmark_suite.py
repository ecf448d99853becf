#!/usr/bin/env python
"""The test suite's time, measured (not a test): scripts/test.sh once, as CI runs it.
pytest's time, the CPU time of every process, the result and the longest files (pytest's
--durations; benchmarks/suite_time.py says what it runs). Replaces the section between the markers in
docs/benchmarks.md; a suite that does not pass writes nothing there. On an idle machine:

  .venv/bin/python scripts/benchmark_suite.py --imitate-avx2   # as on an AVX2-only CPU; ~6-15 min
  .venv/bin/python scripts/benchmark_suite.py -- -k plan       # pytest's arguments after --
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import suite_time  # noqa: E402
from benchmarks.harness import ROOT, command_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"),
                        help="the Markdown file whose suite-time section is replaced")
    parser.add_argument("--log", default=None,
                        help="where the suite's output goes (default: a new temporary file)")
    parser.add_argument("--imitate-avx2", action="store_true",
                        help="run as on a CPU without AVX-512 (ATen's and oneDNN's AVX2 code)")
    parser.add_argument("pytest_args", nargs="*", help="pytest's arguments, after --")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, path in (("--out", args.out), ("--log", args.log)):
        # checked before a run of several minutes, not after it
        if path and not writable(Path(path)):
            parser.error(f"{flag} {path}: cannot write there")
    log = Path(args.log) if args.log else Path(
        tempfile.mkstemp(prefix="benchmark_suite-", suffix=".log")[1])
    return suite_time.main(args.pytest_args, args.imitate_avx2, Path(args.out), log,
                           command_of("scripts/benchmark_suite.py", argv))


def writable(path: Path) -> bool:
    """A file that can be written: an existing one, or a new one in an existing directory."""
    if path.exists():
        return path.is_file() and os.access(path, os.W_OK)
    return path.parent.is_dir() and os.access(path.parent, os.W_OK)


if __name__ == "__main__":
    sys.exit(main())
