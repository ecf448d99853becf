#!/usr/bin/env bash
# The test suite: installs the pinned environment (scripts/setup.sh), then runs pytest.
# Extra arguments go to pytest, e.g. scripts/test.sh -k plan
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-65536}"
exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
