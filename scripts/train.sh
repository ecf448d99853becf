#!/usr/bin/env bash
# Thin wrapper: fairseq-train with the FSDP2 plugin on NPROC ranks (torchrun), CPU or GPU.
#   NPROC=2 scripts/train.sh DATA_DIR [fairseq-train flags...]
# Adds --user-dir and --ddp-backend fsdp2 (a later --ddp-backend on the command line wins).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
bash "$root/scripts/setup.sh"
# glibc keeps freed memory without this, and RSS-based peak memory creeps upward step by step
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-65536}"
# the command line checked in one process first: bad input is one line (exit status 2) before
# torchrun starts, not a line per rank and torchrun's report of the failed workers; the check's
# own log (fairseq's and hydra's import notes) is shown only if it fails otherwise
status=0
check="$(PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$root/.venv/bin/python" \
  -m fairseq_fsdp2.command_line.before_torchrun "${NPROC:-2}" --user-dir "$root/fairseq_fsdp2" \
  --ddp-backend fsdp2 "$@" 2>&1)" || status=$?
if (( status )); then
  grep '^fairseq_fsdp2: error:' <<<"$check" >&2 || printf '%s\n' "$check" >&2
  exit "$status"
fi
exec "$root/.venv/bin/torchrun" --nproc_per_node "${NPROC:-2}" "$root/.venv/bin/fairseq-train" \
  --user-dir "$root/fairseq_fsdp2" --ddp-backend fsdp2 "$@"
