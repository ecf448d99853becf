#!/usr/bin/env bash
# Encode and binarize raw parallel text for translation_multi_simple_epoch (NLLB layout).
#   scripts/prepare_data.sh RAW_DIR DEST [--vocab-size N | --spm-model M] [--dict D] [--overwrite] ...
#   scripts/prepare_data.sh --numbers RAW_DIR [--lang-pairs ...]   # write the demo numbers corpus
# All flags: scripts/prepare_data.sh --help (see fairseq_fsdp2/data/prepare.py).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$root/.venv/bin/python"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
[[ -x "$py" ]] || { echo "prepare_data: error: $py not found (run scripts/setup.sh)" >&2; exit 1; }
if [[ "${1:-}" == "--numbers" ]]; then
  shift
  exec "$py" -m fairseq_fsdp2.data.numbers "$@"
fi
exec "$py" -m fairseq_fsdp2.data.prepare "$@"
