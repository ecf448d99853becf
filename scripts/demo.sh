#!/usr/bin/env bash
# The demo: a 2-rank FSDP2 fairseq-train run on a small synthetic translation corpus (CPU).
# Prints the sharding plan and every rank's peak memory; writes under demo_output/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${DEMO_OUTPUT:-$root/demo_output}"
bash "$root/scripts/setup.sh"
py="$root/.venv/bin/python"
echo "[demo] writing and binarizing a synthetic corpus under $out/corpus"
rm -rf "$out"
"$py" -c "import sys; sys.path.insert(0, '$root/tests'); from corpus import make_corpus; \
from pathlib import Path; make_corpus(Path('$out/corpus'))"
echo "[demo] training a tiny transformer on 2 CPU ranks with --ddp-backend fsdp2"
NPROC=2 bash "$root/scripts/train.sh" "$out/corpus/bin" --cpu \
  --task translation --arch transformer --share-all-embeddings \
  --encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 64 --decoder-embed-dim 64 \
  --encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128 \
  --encoder-attention-heads 4 --decoder-attention-heads 4 \
  --encoder-normalize-before --decoder-normalize-before \
  --min-params-to-wrap 10000 --fsdp2-root-reshard always \
  --optimizer adam --lr 2e-3 --clip-norm 1.0 --criterion label_smoothed_cross_entropy \
  --label-smoothing 0.1 --max-tokens 1000 --max-update 60 --log-interval 10 \
  --no-epoch-checkpoints --save-dir "$out/checkpoints" --no-progress-bar
echo "[demo] per-rank peak memory per log interval: $out/checkpoints/memory.jsonl"
tail -n 2 "$out/checkpoints/memory.jsonl"
