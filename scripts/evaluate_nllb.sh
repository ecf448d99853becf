#!/usr/bin/env bash
# Evaluate NLLB models as NLLB is evaluated: every direction of a prepared test set translated
# with NLLB's generation settings, chrF++ / spBLEU / BLEU per direction (sacreBLEU, signatures),
# optionally against the model fine-tuning started from (the forgetting check).
#   scripts/evaluate_nllb.sh DATA MODEL [--baseline BASE] [--directions a-b,c-d] [--out DIR]
#                            [--max-drop 1 --fail-on-drop] [--plot] [--spbleu-model FILE] ...
# All flags: scripts/evaluate_nllb.sh --help (fairseq_fsdp2/evaluate.py, docs/evaluation.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$root/.venv/bin/python"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
[[ -x "$py" ]] || { echo "evaluate_nllb: error: $py not found (run scripts/setup.sh)" >&2; exit 1; }
exec "$py" -m fairseq_fsdp2.evaluate "$@"
