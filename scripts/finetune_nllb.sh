#!/usr/bin/env bash
# Fine-tune an NLLB-200 dense model with NLLB's recipe on N ranks with FSDP2 (torchrun +
# fairseq-train --user-dir fairseq_fsdp2 --ddp-backend fsdp2). Options: --help; the recipe, its
# checks and the command are recipes/finetune_nllb.py's, run by path: standard
# library only, so --help, --dry-run and bad input need no environment.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "${PYTHON:-python3}" "$root/recipes/finetune_nllb.py" "$@"
