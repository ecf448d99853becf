#!/usr/bin/env bash
# Fine-tune an NLLB-200 dense model with NLLB's fine-tuning recipe on N ranks with FSDP2
# (torchrun + fairseq-train --user-dir fairseq_fsdp2 --ddp-backend fsdp2).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prog="finetune_nllb"

usage() {
  cat <<'EOF'
Usage: scripts/finetune_nllb.sh --data DIR [options] [-- extra fairseq-train flags]

Fine-tune an NLLB-200 dense model with NLLB's recipe (translation_multi_simple_epoch, source
and target language tokens, Adam (0.9,0.98) eps 1e-6, inverse_sqrt from 1e-7, label-smoothed
cross-entropy 0.1, 512 positions, --skip-invalid-size-inputs-valid-test) on N ranks with
PyTorch FSDP2: one torchrun call of fairseq-train --user-dir fairseq_fsdp2 --ddp-backend fsdp2,
printed before it starts, with the memory estimator's per-rank prediction for it
(python -m fairseq_fsdp2.estimate). Rank 0 prints the sharding plan; every rank's peak memory is logged at
each --log-interval (mem_peak_gb_max ...) and written to SAVE_DIR/memory.jsonl. At the end,
SAVE_DIR/checkpoint_{best,last}_consolidated.pt are written in stock fairseq format.

Each option can also be set by the environment variable in brackets; an option wins.

  --data DIR              [DATA] binarized data from scripts/prepare_data.sh (required):
                          {split}.{src}-{tgt}.{lang}.{bin,idx}, dict.{lang}.txt, langs.txt,
                          lang_pairs.txt
  --model-size SIZE       [MODEL_SIZE] 600m | 1.3b | 3.3b | tiny (default: 600m), i.e.
                          --arch transformer_nllb_600m | _1_3b | _3_3b | _tiny (tiny: 2+2
                          layers of 64, for tests and the CPU demo)
  --pretrained CKPT       [PRETRAINED] stock fairseq checkpoint, or Hugging Face NLLB model
                          directory / .safetensors file, to start from (--finetune-from-model:
                          weights only; optimizer, lr schedule and data position start fresh).
                          Default: none, train from scratch. The NLLB-200 checkpoints need
                          their own SentencePiece model and dictionary: prepare with
                          --spm-model, --dict and --dict-langs nllb200 (fairseq files) or with
                          --hf-model DIR (Hugging Face weights)
  --lang-pairs LIST       [LANG_PAIRS] comma-separated SRC-TGT training directions
                          (default: DATA/lang_pairs.txt)
  --langs LIST            [LANGS] comma-separated languages, in dictionary order (their
                          __lang__ token ids depend on it; default: DATA/langs.txt)
  --nproc N               [NPROC] processes (ranks) on this machine (default: the number of
                          GPUs; 2 with --cpu)
  --save-dir DIR          [SAVE_DIR] checkpoints, memory.jsonl (default:
                          checkpoints/nllb_SIZE)
  --max-update N          [MAX_UPDATE] updates to train (default: 10000)
  --max-tokens N          [MAX_TOKENS] tokens per batch per rank (default: 4096)
  --update-freq N         [UPDATE_FREQ] batches accumulated per update (default: 1)
  --lr LR                 [LR] peak learning rate (default: 5e-5, NLLB's fine-tuning lr)
  --warmup-updates N      [WARMUP_UPDATES] inverse_sqrt warm-up from 1e-7 to LR (default:
                          MAX_UPDATE/10, at most 4000)
  --root-reshard MODE     [ROOT_RESHARD] --fsdp2-root-reshard: always | default (default:
                          always; default with --speed). always: the root and the
                          shared-embedding unit reshard after forward and are gathered again
                          (less memory: the 256k x dim embedding is 262M params on the 600M
                          model); default: they stay gathered from forward to backward (one
                          all-gather of the embedding less per step)
  --loss-chunk-tokens N   [LOSS_CHUNK_TOKENS] the loss's output projection, log-softmax and
                          gradients run over chunks of N target tokens in one pass
                          (label_smoothed_cross_entropy_chunked): the tokens x 256k logits never
                          exist at once (default: 256); 0: fairseq's
                          label_smoothed_cross_entropy
  --speed                 [SPEED=1] prefer words/s to memory: --root-reshard default unless
                          given. The chunked loss and the tied-embedding gradient buffer stay
                          on (they cost no speed; --fsdp2-no-tied-grad-buffer after -- turns
                          the buffer off)
  --min-params-to-wrap N  [MIN_PARAMS_TO_WRAP] a transformer layer with >= N parameters becomes
                          its own FSDP2 unit (default: 1, every layer). NLLB's own recipe used
                          100000000 (1e8) with fairscale: no NLLB layer is that large (600M:
                          12.6M encoder / 16.8M decoder layer), so 1e8 wraps nothing, the whole
                          model is one unit and memory per rank barely drops
  --precision P           [PRECISION] fp16 | bf16 | fp32 (default: fp16 on GPU, as NLLB's
                          --memory-efficient-fp16: fp16 compute, fp32 sharded master weights,
                          loss scaling; fp32 with --cpu)
  --cpu                   [CPU=1] train on CPU (gloo); also --num-workers 0 (see NUM_WORKERS).
                          Default: CPU when no GPU is visible (nvidia-smi)
  --num-workers N         [NUM_WORKERS] data loader worker processes (default: fairseq's 1 on
                          GPU, 0 on CPU: each worker costs about 5 s to shut down at every
                          validation and checkpoint, longer than a tiny model's epoch)
  --log-interval N        [LOG_INTERVAL] updates between log lines (default: 100)
  --seed N                [SEED] (default: 2)
  --dry-run               [DRY_RUN=1] print the torchrun command (shell-quoted, one line on
                          stdout) and stop: nothing is installed or launched. Its fairseq-train
                          flags are the ones to run under your own torchrun or srun
  -h, --help              this help
  -- ARGS                 everything after -- goes to fairseq-train unchanged, after the
                          flags above (a repeated flag wins), e.g. -- --save-interval-updates
                          1000 --log-format json --fsdp2-replicate-degree 2

Several nodes: run the printed fairseq-train flags under your own torchrun (--nnodes,
--rdzv-endpoint) or SLURM; see docs/launching.md.
EOF
}

die() { echo "$prog: error: $*" >&2; exit 2; }

# --- arguments -------------------------------------------------------------------------------
DATA="${DATA:-}"; MODEL_SIZE="${MODEL_SIZE:-600m}"; PRETRAINED="${PRETRAINED:-}"
LANG_PAIRS="${LANG_PAIRS:-}"; LANGS="${LANGS:-}"; NPROC="${NPROC:-}"; SAVE_DIR="${SAVE_DIR:-}"
MAX_UPDATE="${MAX_UPDATE:-10000}"; MAX_TOKENS="${MAX_TOKENS:-4096}"; UPDATE_FREQ="${UPDATE_FREQ:-1}"
LR="${LR:-5e-5}"; WARMUP_UPDATES="${WARMUP_UPDATES:-}"; ROOT_RESHARD="${ROOT_RESHARD:-}"
MIN_PARAMS_TO_WRAP="${MIN_PARAMS_TO_WRAP:-1}"; PRECISION="${PRECISION:-}"; CPU="${CPU:-}"
NUM_WORKERS="${NUM_WORKERS:-}"; LOG_INTERVAL="${LOG_INTERVAL:-100}"; SEED="${SEED:-2}"
LOSS_CHUNK_TOKENS="${LOSS_CHUNK_TOKENS:-256}"; SPEED="${SPEED:-}"; DRY_RUN="${DRY_RUN:-}"
extra=()
while [[ $# -gt 0 ]]; do
  arg="$1"
  if [[ "$arg" == --*=* ]]; then set -- "${arg%%=*}" "${arg#*=}" "${@:2}"; arg="$1"; fi
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --cpu) CPU=1; shift; continue ;;
    --speed) SPEED=1; shift; continue ;;
    --dry-run) DRY_RUN=1; shift; continue ;;
    --) shift; extra=("$@"); break ;;
    --data|--model-size|--pretrained|--lang-pairs|--langs|--nproc|--save-dir|--max-update|\
    --max-tokens|--update-freq|--lr|--warmup-updates|--root-reshard|--min-params-to-wrap|\
    --precision|--num-workers|--log-interval|--seed|--loss-chunk-tokens)
      [[ $# -ge 2 ]] || die "$arg needs a value"
      value="$2"; shift 2 ;;
    *) die "unknown argument '$arg' (fairseq-train flags go after --; see --help)" ;;
  esac
  case "$arg" in
    --data) DATA="$value" ;; --model-size) MODEL_SIZE="$value" ;;
    --pretrained) PRETRAINED="$value" ;; --lang-pairs) LANG_PAIRS="$value" ;;
    --langs) LANGS="$value" ;; --nproc) NPROC="$value" ;; --save-dir) SAVE_DIR="$value" ;;
    --max-update) MAX_UPDATE="$value" ;; --max-tokens) MAX_TOKENS="$value" ;;
    --update-freq) UPDATE_FREQ="$value" ;; --lr) LR="$value" ;;
    --warmup-updates) WARMUP_UPDATES="$value" ;; --root-reshard) ROOT_RESHARD="$value" ;;
    --min-params-to-wrap) MIN_PARAMS_TO_WRAP="$value" ;; --precision) PRECISION="$value" ;;
    --num-workers) NUM_WORKERS="$value" ;; --log-interval) LOG_INTERVAL="$value" ;;
    --seed) SEED="$value" ;; --loss-chunk-tokens) LOSS_CHUNK_TOKENS="$value" ;;
  esac
done

# --- checks (all before anything is launched) -------------------------------------------------
case "$MODEL_SIZE" in
  600m|1.3b|3.3b|tiny) arch="transformer_nllb_${MODEL_SIZE//./_}" ;;
  *) die "unknown model size '$MODEL_SIZE' (choose 600m, 1.3b, 3.3b or tiny)" ;;
esac
[[ -n "$DATA" ]] || die "--data DIR is required (binarized data from scripts/prepare_data.sh)"
[[ -d "$DATA" ]] || die "data directory $DATA does not exist"
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
for pair in "MAX_UPDATE:$MAX_UPDATE" "MAX_TOKENS:$MAX_TOKENS" "UPDATE_FREQ:$UPDATE_FREQ" \
            "MIN_PARAMS_TO_WRAP:$MIN_PARAMS_TO_WRAP" "LOG_INTERVAL:$LOG_INTERVAL" "SEED:$SEED" \
            "LOSS_CHUNK_TOKENS:$LOSS_CHUNK_TOKENS" \
            "NPROC:${NPROC:-1}" "WARMUP_UPDATES:${WARMUP_UPDATES:-0}" "NUM_WORKERS:${NUM_WORKERS:-0}"; do
  is_uint "${pair#*:}" || die "${pair%%:*} must be a non-negative integer, got '${pair#*:}'"
done
[[ -z "$NPROC" || "$NPROC" -ge 1 ]] || die "NPROC must be >= 1"
[[ "$LR" =~ ^[0-9.]+([eE][-+]?[0-9]+)?$ ]] || die "LR must be a number, got '$LR'"
[[ -z "$SPEED" || "$SPEED" == 0 || "$SPEED" == 1 ]] || die "SPEED must be 0 or 1, got '$SPEED'"
[[ -z "$DRY_RUN" || "$DRY_RUN" == 0 || "$DRY_RUN" == 1 ]] || die "DRY_RUN must be 0 or 1, got '$DRY_RUN'"
if [[ -z "$ROOT_RESHARD" ]]; then
  ROOT_RESHARD="$([[ "$SPEED" == 1 ]] && echo default || echo always)"
fi
case "$ROOT_RESHARD" in default|always) ;; *)
  die "unknown root reshard '$ROOT_RESHARD' (choose default or always)" ;; esac
if [[ -n "$PRETRAINED" && ! -e "$PRETRAINED" ]]; then
  die "pretrained checkpoint $PRETRAINED does not exist"
fi

if [[ -z "$LANG_PAIRS" ]]; then
  [[ -f "$DATA/lang_pairs.txt" ]] || die "no --lang-pairs given and $DATA/lang_pairs.txt not found"
  LANG_PAIRS="$(tr -d ' \n' < "$DATA/lang_pairs.txt")"
fi
if [[ -z "$LANGS" ]]; then
  [[ -f "$DATA/langs.txt" ]] || die "no --langs given and $DATA/langs.txt not found"
  LANGS="$(tr -d ' \n' < "$DATA/langs.txt")"
fi
[[ -n "$LANG_PAIRS" ]] || die "the language pair list is empty"
IFS=, read -r -a pairs <<< "$LANG_PAIRS"
for pair in "${pairs[@]}"; do
  [[ "$pair" =~ ^[^-,]+-[^-,]+$ ]] || die "malformed language pair '$pair' (expected SRC-TGT)"
  src="${pair%-*}"; tgt="${pair#*-}"
  for lang in "$src" "$tgt"; do
    [[ ",$LANGS," == *",$lang,"* ]] || die "language $lang of pair $pair is not in the language list ($LANGS)"
    [[ -f "$DATA/dict.$lang.txt" ]] || die "$DATA has no dict.$lang.txt (needed for pair $pair)"
    # fairseq reads a pair's files in either direction: train.src-tgt.* or train.tgt-src.*
    if [[ ! -f "$DATA/train.$src-$tgt.$lang.idx" && ! -f "$DATA/train.$tgt-$src.$lang.idx" ]]; then
      die "$DATA has no training data for pair $pair (train.$src-$tgt.$lang.idx/.bin not found)"
    fi
  done
done

# --- device, precision, defaults --------------------------------------------------------------
if [[ -z "$CPU" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    CPU=0
  else
    CPU=1
  fi
fi
[[ "$CPU" == 0 || "$CPU" == 1 ]] || die "CPU must be 0 or 1, got '$CPU'"
if [[ -z "$NPROC" ]]; then
  if [[ "$CPU" == 1 ]]; then NPROC=2; else NPROC="$(nvidia-smi -L | grep -c '^GPU')"; fi
fi
PRECISION="${PRECISION:-$([[ "$CPU" == 1 ]] && echo fp32 || echo fp16)}"
case "$PRECISION" in
  fp16) precision_flags=(--memory-efficient-fp16) ;;
  bf16) precision_flags=(--bf16) ;;
  fp32) precision_flags=() ;;
  *) die "unknown precision '$PRECISION' (choose fp16, bf16 or fp32)" ;;
esac
if [[ -z "$WARMUP_UPDATES" ]]; then
  WARMUP_UPDATES=$(( MAX_UPDATE / 10 )); (( WARMUP_UPDATES <= 4000 )) || WARMUP_UPDATES=4000
  (( WARMUP_UPDATES >= 1 )) || WARMUP_UPDATES=1
fi
SAVE_DIR="${SAVE_DIR:-checkpoints/nllb_$MODEL_SIZE}"
device_flags=()
if [[ "$CPU" == 1 ]]; then
  device_flags=(--cpu --num-workers "${NUM_WORKERS:-0}")
elif [[ -n "$NUM_WORKERS" ]]; then
  device_flags=(--num-workers "$NUM_WORKERS")
fi
if (( LOSS_CHUNK_TOKENS > 0 )); then
  loss_flags=(--criterion label_smoothed_cross_entropy_chunked --loss-chunk-tokens "$LOSS_CHUNK_TOKENS")
else
  loss_flags=(--criterion label_smoothed_cross_entropy)
fi
pretrained_flags=()
[[ -z "$PRETRAINED" ]] || pretrained_flags=(--finetune-from-model "$PRETRAINED")

# --- launch ----------------------------------------------------------------------------------
train_flags=("$DATA"
  --user-dir "$root/fairseq_fsdp2" --ddp-backend fsdp2
  --arch "$arch" "${pretrained_flags[@]}"
  --task translation_multi_simple_epoch --lang-pairs "$LANG_PAIRS" --langs "$LANGS"
  --encoder-langtok src --decoder-langtok
  --max-source-positions 512 --max-target-positions 512 --skip-invalid-size-inputs-valid-test
  --optimizer adam --adam-betas '(0.9,0.98)' --adam-eps 1e-6
  --lr "$LR" --lr-scheduler inverse_sqrt --warmup-init-lr 1e-7 --warmup-updates "$WARMUP_UPDATES"
  "${loss_flags[@]}" --label-smoothing 0.1
  --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE"
  --min-params-to-wrap "$MIN_PARAMS_TO_WRAP" --fsdp2-root-reshard "$ROOT_RESHARD"
  "${precision_flags[@]}" "${device_flags[@]}"
  --save-dir "$SAVE_DIR" --seed "$SEED" --log-interval "$LOG_INTERVAL" --no-progress-bar
  "${extra[@]}")
cmd=("$root/.venv/bin/torchrun" --standalone --nproc_per_node "$NPROC"
  "$root/.venv/bin/fairseq-train" "${train_flags[@]}")
if [[ "$DRY_RUN" == 1 ]]; then
  printf '%q ' "${cmd[@]}" | sed 's/ $//'; echo
  exit 0
fi
bash "$root/scripts/setup.sh"
# glibc keeps freed memory without this, and RSS-based peak memory (CPU) creeps up step by step
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-65536}"
echo "[$prog] $arch on $NPROC rank(s) ($([[ "$CPU" == 1 ]] && echo CPU || echo GPU), $PRECISION), $LANG_PAIRS -> $SAVE_DIR" >&2
echo "[$prog] $(printf '%q ' "${cmd[@]}")" >&2
# the estimator reads the same flags (fairseq's parser); a failure does not stop training
echo "[$prog] predicted per-rank memory for this command:" >&2
"$root/.venv/bin/python" -m fairseq_fsdp2.estimate "${train_flags[@]}" --world-size "$NPROC" >&2 \
  || echo "[$prog] (no prediction: the estimator failed; training starts anyway)" >&2
exec "${cmd[@]}"
