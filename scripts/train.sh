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
exec "$root/.venv/bin/torchrun" --nproc_per_node "${NPROC:-2}" "$root/.venv/bin/fairseq-train" \
  --user-dir "$root/fairseq_fsdp2" --ddp-backend fsdp2 "$@"
