"""Regenerate every predicted table in the docs from the estimator (or, with --check, say which
differ and exit 1). The tables and the command of each row: fairseq_fsdp2/estimator/doc_tables.py.

    .venv/bin/python scripts/predicted_tables.py [--check]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fsdp2.estimator.doc_tables import TABLES, documented, render, replaced  # noqa: E402
from fairseq_fsdp2.estimator.from_args import ModelCache  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a documented table differs")
    args = parser.parse_args(argv)
    stale = []
    models = ModelCache()  # each meta model built once for every table
    for table in TABLES:
        path = ROOT / table.document
        text = path.read_text()
        if args.check:
            if documented(text, table.name) != render(table, models=models):
                stale.append(f"{table.document}: {table.name}")
            continue
        path.write_text(replaced(text, table, models))
        print(f"wrote {table.document}: {table.name}")
    for entry in stale:
        print(f"stale: {entry}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
