#!/usr/bin/env bash
# The test suite: installs the pinned environment (scripts/setup.sh), then runs pytest.
# Extra arguments go to pytest, e.g. scripts/test.sh -k plan, or scripts/test.sh -m "not slow"
# while iterating (leaves out the tests marked slow, pyproject.toml); without them: everything.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
# Every rank process imports the plugin from source; where PYTHONDONTWRITEBYTECODE is set (it was
# on the machine this was measured on) nothing caches its bytecode, and each of the suite's ~270
# processes compiles it again (0.22 CPU-s against 0.14 from bytecode, measured on an AMD EPYC). compileall writes
# the cache anyway, and Python reads it whatever that variable says.
"$root/.venv/bin/python" -m compileall -q fairseq_fsdp2 tests >/dev/null
# The 8-bit moments' C++ kernel (fairseq_fsdp2/optimizer/moments/kernels.py): setup.sh built it when it
# installed; loaded here (or built again, where PyTorch's cache was cleared since) rather than
# by the first test process that needs it.
"$root/.venv/bin/python" scripts/build_kernels.py
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-65536}"
# The test-only packages setup.sh installed (.venv/fixture-deps) are part of the suite: a
# missing one fails the tests that need it instead of skipping them (tests/conftest.py).
export FAIRSEQ_FSDP2_REQUIRE_FIXTURE_DEPS=1
# Two pytest workers (pytest-xdist), one per core: alone, the suite leaves a core idle a third
# of the time (ranks waiting on each other, heartbeat timeouts, one-process steps). Each worker
# takes whole files (--dist loadfile), so a file's shared runs are made once, longest files
# first (tests/conftest.py; --no-loadscope-reorder keeps that order). `-n 0` (given after, it
# wins) runs everything in this process.
exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
  --no-loadscope-reorder "$@"
