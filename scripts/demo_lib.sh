# Shared by scripts/demo.sh and scripts/demo_add_language.sh (sourced, not run): stock
# fairseq-generate (no --user-dir) on a consolidated checkpoint, then sacreBLEU and a few
# translations.
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
