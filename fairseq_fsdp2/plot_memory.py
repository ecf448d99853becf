"""``python -m fairseq_fsdp2.plot_memory MEMORY_JSONL OUT.png``: per-rank peak over updates.

Reads the ``<save-dir>/memory.jsonl`` a run wrote (one line per log interval) and draws one line
per rank. ``--predicted-gb X`` adds the estimator's prediction as a dashed line.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .errors import FSDP2Error, report_bad_input, unwritable
from .memory.charts import plot_memory_log, read_memory_log
from .process import quiet


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fairseq_fsdp2.plot_memory",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("memory_jsonl", help="a run's <save-dir>/memory.jsonl")
    parser.add_argument("out_png", help="the PNG to write")
    parser.add_argument("--title", default=None)
    parser.add_argument("--predicted-gb", type=float, default=None,
                        help="draw the estimator's predicted per-rank peak")
    args = parser.parse_args(argv)
    problem = unwritable(os.path.dirname(os.path.abspath(args.out_png)))
    if problem:
        print(f"fairseq_fsdp2.plot_memory: error: cannot write {args.out_png}: {problem}",
              file=sys.stderr)
        return 2
    try:
        records = read_memory_log(args.memory_jsonl)
    except (OSError, ValueError) as e:
        return report_bad_input("fairseq_fsdp2.plot_memory", e)
    try:
        out = plot_memory_log(records, args.out_png, title=args.title,
                              predicted_gb=args.predicted_gb)
    except FSDP2Error as e:  # no matplotlib
        return report_bad_input("fairseq_fsdp2.plot_memory", e)
    print(f"wrote {out} ({len(records)} intervals, {len(records[0]['ranks'])} rank(s))")
    return 0


if __name__ == "__main__":
    quiet.no_debug_log()
    sys.exit(main())
