#!/usr/bin/env bash
# The add-a-language demo (CPU, a few minutes on 2 cores): a language the pretrained model never
# saw, added to its vocabulary, fine-tuned with FSDP2, translated into by stock fairseq-generate.
#   1. set up .venv (scripts/setup.sh)
#   2. the "pretrained" model: transformer_nllb_tiny trained on numbers in English, French and
#      German (eng_Latn-fra_Latn, eng_Latn-deu_Latn) on 2 CPU ranks, 200 updates
#   3. Latin (lat_Latn, not an NLLB-200 language either) added: scripts/prepare_data.sh with the
#      model's SentencePiece model and dictionary, --add-langs lat_Latn and --train-pieces
#      (Latin pieces the model's SentencePiece model lacks)
#   4. fine-tune it on eng_Latn-lat_Latn (150 updates) from the pretrained checkpoint: the
#      shared embedding grows on loading, __lat_Latn__'s row starting from __fra_Latn__'s
#      (--init-new-langs-from lat_Latn=fra_Latn)
#   5. stock fairseq-generate (no --user-dir): BLEU on held-out numbers, eng_Latn -> lat_Latn
# Outputs under ${DEMO_OUTPUT:-demo_add_language_output}; logs there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/demo_lib.sh
source "$root/scripts/demo_lib.sh"
out="${DEMO_OUTPUT:-$root/demo_add_language_output}"
start=$SECONDS
demo_begin "$out"
show='/predicted per-rank memory/ { next }
      / \| (train_inner|fairseq_fsdp2[._a-z]*) \| / { print "[demo]   " $0; next }
      /^\[finetune_nllb\]|[Ee]rror|Traceback/ { print "[demo]   " $0 }'

step 2 "the pretrained model: numbers in eng_Latn, fra_Latn, deu_Latn, 200 updates"
bash "$root/scripts/prepare_data.sh" --numbers "$out/raw_base" \
  --lang-pairs eng_Latn-fra_Latn,eng_Latn-deu_Latn --n-train 4000 --n-valid 200 --n-test 0 \
  > /dev/null 2> >(quiet)
bash "$root/scripts/prepare_data.sh" "$out/raw_base" "$out/data_base" --vocab-size 300 \
  --quiet 2> >(quiet)
# no validation, one save at the end: the numbers' epochs are a few updates long
demo_train "$out/train_base.log" "$show" --data "$out/data_base" --save-dir "$out/pretrained" \
  --max-update 200 --lr 4e-3 --warmup-updates 30 --log-interval 100 \
  -- --clip-norm 1.0 --disable-validation --save-interval 1000 --no-epoch-checkpoints \
  --log-format simple || exit 1
pretrained="$out/pretrained/checkpoint_last_consolidated.pt"

step 3 "add lat_Latn and Latin pieces to its vocabulary (prepare_data.sh --add-langs --train-pieces)"
bash "$root/scripts/prepare_data.sh" --numbers "$out/raw_lat" --lang-pairs eng_Latn-lat_Latn \
  --n-train 4000 --n-valid 200 --n-test 200 > /dev/null 2> >(quiet)
bash "$root/scripts/prepare_data.sh" "$out/raw_lat" "$out/data_lat" \
  --spm-model "$out/data_base/spm.model" --dict "$out/data_base/dict.txt" \
  --add-langs lat_Latn --train-pieces 80 2> >(quiet) | grep -E "growing|dictionary:" \
  | sed 's/^/[demo]   /'
"$py" - "$out/data_base/spm.model" "$out/data_lat/spm.model" "$out/raw_lat" <<'EOF'
import sentencepiece as spm, sys
text = "septem milia quadringenti duodeviginti"
for name, path in (("the pretrained model's", sys.argv[1]), ("grown", sys.argv[2])):
    pieces = spm.SentencePieceProcessor(model_file=path).encode(text, out_type=str)
    print(f"[demo]   {name} SentencePiece model: {text!r} -> {' '.join(pieces)}")
EOF

step 4 "fine-tune on eng_Latn-lat_Latn from the pretrained checkpoint, 2 CPU ranks, FSDP2"
demo_train "$out/train_lat.log" "$show" --data "$out/data_lat" --pretrained "$pretrained" \
  --save-dir "$out/checkpoints" --max-update 150 --lr 3e-3 --warmup-updates 20 \
  --log-interval 50 \
  -- --clip-norm 1.0 --disable-validation --save-interval 1000 --no-epoch-checkpoints \
  --log-format simple --init-new-langs-from lat_Latn=fra_Latn || exit 1

ckpt="$out/checkpoints/checkpoint_last_consolidated.pt"
step 5 "stock fairseq-generate (no --user-dir) on $(basename "$ckpt"), eng_Latn -> lat_Latn"
demo_generate "$py" "$out/data_lat" "$ckpt" eng_Latn-lat_Latn eng_Latn lat_Latn \
  "$out/generate.eng_Latn-lat_Latn.txt" "$out/generate.log" || exit 1
echo "[demo] done in $((SECONDS - start)) s; outputs under $out"
