# Shared by scripts/demo.sh and scripts/demo_add_language.sh (sourced, not run): their first
# step, training through scripts/finetune_nllb.sh, and stock fairseq-generate (no --user-dir) on
# a consolidated checkpoint, then sacreBLEU and a few translations.
demo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

step() { echo "[demo] step $1/${demo_steps:-5}: $2"; }  # demo_steps: a demo's count
quiet() { grep -v tensorboardX >&2 || true; }  # fairseq's import-time notice, not ours

#   demo_begin OUT: step 1 (the environment, scripts/setup.sh), then OUT emptied; sets py
demo_begin() {
  step 1 "environment (scripts/setup.sh)"
  bash "$demo_root/scripts/setup.sh"
  py="$demo_root/.venv/bin/python"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  rm -rf "$1"
  mkdir -p "$1"
}

#   demo_train LOG SHOW ARGS...: scripts/finetune_nllb.sh ARGS, the tiny model on 2 CPU ranks;
#   its whole output in LOG, the lines the awk program SHOW picks on stdout, LOG's end if it fails
demo_train() {
  local log="$1" show="$2"
  shift 2
  if ! bash "$demo_root/scripts/finetune_nllb.sh" --model-size tiny --cpu --nproc 2 \
      --max-tokens 4000 --root-reshard always --seed 1 "$@" 2>&1 | tee "$log" \
      | awk "$show"; then
    echo "[demo] training failed; the end of $log:" >&2
    tail -n 30 "$log" >&2
    return 1
  fi
}

#   demo_generate PY DATA CKPT LANG_PAIRS SRC TGT OUT_TXT LOG
demo_generate() {
  local py="$1" data="$2" ckpt="$3" pairs="$4" src="$5" tgt="$6" out_txt="$7" log="$8"
  "$(dirname "$py")/fairseq-generate" "$data" --path "$ckpt" \
    --task translation_multi_simple_epoch --lang-pairs "$pairs" \
    --langs "$(cat "$data/langs.txt")" --source-lang "$src" --target-lang "$tgt" \
    --encoder-langtok src --decoder-langtok --gen-subset test --beam 5 --batch-size 128 \
    --required-batch-size-multiple 1 --remove-bpe sentencepiece --scoring sacrebleu \
    --cpu --num-workers 0 > "$out_txt" 2> "$log" || {
    echo "[demo] fairseq-generate failed; the end of $log:" >&2
    tail -n 20 "$log" >&2
    return 1
  }
  "$py" - "$out_txt" "$src" <<'PYEOF'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
bleu = re.search(r"^Generate test with beam=\d+: (BLEU = [\d.]+.*)$", text, re.M)
rows = {}
for line in text.splitlines():
    m = re.match(r"^([STD])-(\d+)\t(.*)$", line)
    if m:
        rows.setdefault(int(m[2]), {})[m[1]] = m[3].split("\t")[-1]
print(f"[demo] {len(rows)} test sentences, sacrebleu: {bleu[1] if bleu else 'no score found'}")
print("[demo] examples (source | reference | model):")
for i in sorted(rows)[:6]:
    r = rows[i]
    source = r["S"].replace(f"__{sys.argv[2]}__ ", "")
    print(f"[demo]   {source}  |  {r.get('T', '')}  |  {r.get('D', '')}")
PYEOF
}
