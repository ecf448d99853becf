#!/usr/bin/env python
"""Build the plugin's C++ CPU kernels now (fairseq_fsdp2/optimizer/moments/kernels.py), instead
of in the first training process that needs them; prints where they are, or why they are not
built (the slower eager code then runs). scripts/setup.sh calls it when it installs,
scripts/test.sh before the tests.

  .venv/bin/python scripts/build_kernels.py
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fairseq_fsdp2.optimizer.moments import kernels  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sys.exit(kernels.main())
