#!/usr/bin/env bash
# The demo (CPU, about 2-3 minutes on 2 cores): NLLB fine-tuning end to end with FSDP2.
#   1. set up .venv (scripts/setup.sh)
#   2. write the numbers corpus: integers in words, eng_Latn-fra_Latn and eng_Latn-deu_Latn
#   3. prepare it: SentencePiece, binarize, __lang__ tokens (scripts/prepare_data.sh)
#   4. train transformer_nllb_tiny on 2 CPU ranks with FSDP2 (scripts/finetune_nllb.sh): the
#      sharding plan and every rank's peak memory are printed
#   5. the evaluation (python -m fairseq_fsdp2.evaluate) of the consolidated checkpoint: both
#      directions of the held-out test numbers translated with NLLB's settings, chrF++, spBLEU
#      and BLEU per direction (docs/evaluation.md)
#   6. export to CTranslate2 int8 and translate three sentences with it
# Outputs under ${DEMO_OUTPUT:-demo_output}; the full training log is train.log there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/demo_lib.sh
source "$root/scripts/demo_lib.sh"
out="${DEMO_OUTPUT:-$root/demo_output}"
start=$SECONDS
demo_steps=6
demo_begin "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # the package, for python -m

pairs="eng_Latn-fra_Latn,eng_Latn-deu_Latn"
step 2 "numbers corpus ($pairs; 4000 training pairs each, 200 held-out valid/test numbers) -> $out/raw"
bash "$root/scripts/prepare_data.sh" --numbers "$out/raw" --lang-pairs "$pairs" \
  --n-train 4000 --n-valid 200 --n-test 200 > /dev/null 2> >(quiet)

step 3 "SentencePiece (vocab 300) + binarize + language tokens -> $out/data"
bash "$root/scripts/prepare_data.sh" "$out/raw" "$out/data" --vocab-size 300 2> >(quiet) \
  | sed 's/^/[demo]   /'

step 4 "train transformer_nllb_tiny on 2 CPU ranks with --ddp-backend fsdp2 (scripts/finetune_nllb.sh)"
echo "[demo]   plan, training/validation lines (mem_peak_gb_* = peak memory over the ranks); full log: $out/train.log"
# Only the lines worth watching: the sharding plan, training/validation records, the plugin's
# own messages, errors. Everything goes to train.log.
show='
  /FSDP2 sharding plan/ { plan = 1 }
  plan && / \| (INFO|WARNING) \| / { plan = 0 }
  plan { print "[demo]   " $0; next }
  / \| (train_inner|valid|fairseq_fsdp2[._a-z]*) \| / { print "[demo]   " $0; next }
  /^\[finetune_nllb\]|done training|[Ee]rror|Traceback/ { print "[demo]   " $0 }'
demo_train "$out/train.log" "$show" --data "$out/data" --save-dir "$out/checkpoints" \
  --max-update 200 --lr 4e-3 --warmup-updates 30 --log-interval 40 \
  -- --clip-norm 1.0 --no-epoch-checkpoints --log-format simple || exit 1
"$py" - "$out/checkpoints/memory.jsonl" <<'EOF'
import json, sys
last = [json.loads(line) for line in open(sys.argv[1])][-1]
ranks = ", ".join(f"rank {r['rank']}: {r['peak_gb']:.3f} GB" for r in last["ranks"])
print(f"[demo]   per-rank peak memory at update {last['num_updates']} ({last['device']}): {ranks}")
print(f"[demo]   every interval: {sys.argv[1]}")
EOF

ckpt="$out/checkpoints/checkpoint_best_consolidated.pt"
step 5 "evaluate $(basename "$ckpt") on the test split, every direction (python -m fairseq_fsdp2.evaluate)"
# spBLEU with the corpus's own SentencePiece model (FLORES-200's is not here offline); the
# signature names it by its hash (docs/evaluation.md)
if ! "$py" -m fairseq_fsdp2.evaluate "$out/data" "$ckpt" --out "$out/evaluation" \
    --spbleu-model "$out/data/spm.model" --no-progress 2> "$out/evaluate.log" \
    | sed 's/^/[demo]   /'; then
  echo "[demo] evaluation failed; the end of $out/evaluate.log:" >&2
  tail -n 20 "$out/evaluate.log" >&2
  exit 1
fi

step 6 "export to CTranslate2 int8 (consolidate --format ctranslate2) and translate with it"
"$py" -m fairseq_fsdp2.consolidate "$ckpt" "$out/ct2_int8" --format ctranslate2 \
  --quantization int8 2> >(quiet) | sed 's/^/[demo]   /'
"$py" - "$out/ct2_int8" "$out/raw/test.eng_Latn-fra_Latn.eng_Latn" <<'EOF'
import sys

import ctranslate2
import sentencepiece

model, sources = sys.argv[1], open(sys.argv[2], encoding="utf-8").read().splitlines()[:3]
sp = sentencepiece.SentencePieceProcessor(model_file=f"{model}/sentencepiece.model")
translator = ctranslate2.Translator(model, device="cpu", compute_type="int8")
results = translator.translate_batch(
    [["__eng_Latn__"] + sp.encode(s, out_type=str) for s in sources],
    target_prefix=[["__fra_Latn__"]] * len(sources), beam_size=4)
for source, result in zip(sources, results):
    text = sp.decode([t for t in result.hypotheses[0] if t != "__fra_Latn__"])  # no tag
    print(f"[demo]   {source}  ->  {text}")
EOF
echo "[demo] done in $((SECONDS - start)) s; outputs under $out"
