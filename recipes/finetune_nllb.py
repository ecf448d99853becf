"""NLLB's fine-tuning recipe on N ranks with FSDP2: the options of ``scripts/finetune_nllb.sh``,
their checks, and the torchrun command of fairseq-train they make.

The recipe is NLLB's (translation_multi_simple_epoch with source and target language tokens,
Adam (0.9, 0.98) eps 1e-6, inverse_sqrt from 1e-7, label-smoothed cross-entropy 0.1, 512
positions) with the plugin's memory settings on: every layer its own unit, the root resharded,
the chunked loss.

Standard library only, and run by path from the script: --help, --dry-run and bad input need
no environment (importing the package would import fairseq: seconds). Not part of the installed
package: a launch runs from a checkout (the repository holding this file), brings ``.venv`` up
to date with ``scripts/setup.sh``, prints the estimator's prediction for the command, then
becomes torchrun.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

PROG = "finetune_nllb"
#: the checkout this file is in (its .venv and scripts/)
ROOT = Path(__file__).resolve().parents[1]
SIZES = ("600m", "1.3b", "3.3b", "tiny")
PRECISION_FLAGS = {"fp16": ["--memory-efficient-fp16"], "bf16": ["--bf16"], "fp32": []}

DESCRIPTION = """\
Fine-tune an NLLB-200 dense model with NLLB's recipe (translation_multi_simple_epoch, source
and target language tokens, Adam (0.9,0.98) eps 1e-6, inverse_sqrt from 1e-7, label-smoothed
cross-entropy 0.1, 512 positions, --skip-invalid-size-inputs-valid-test) on N ranks with
PyTorch FSDP2: one torchrun call of fairseq-train --user-dir fairseq_fsdp2 --ddp-backend fsdp2,
printed before it starts, with the memory estimator's per-rank prediction for it
(python -m fairseq_fsdp2.estimate). Rank 0 prints the sharding plan; every rank's peak memory
is logged at each --log-interval (mem_peak_gb_max ...) and written to SAVE_DIR/memory.jsonl. At
the end, SAVE_DIR/checkpoint_{best,last}_consolidated.pt are written in stock fairseq format.

Each option can also be set by the environment variable in brackets; an option wins."""

EPILOG = """\
  -- ARGS               everything after -- goes to fairseq-train unchanged, after the flags
                        above (a repeated flag wins), e.g. -- --save-interval-updates 1000
                        --log-format json --fsdp2-replicate-degree 2

Several nodes: run the printed fairseq-train flags under your own torchrun (--nnodes,
--rdzv-endpoint) or SLURM; see docs/launching.md."""

#: (flag, environment variable, default, metavar, help) of the options that take a value
VALUED = (
    ("--data", "DATA", "", "DIR", "binarized data from scripts/prepare_data.sh (required): "
     "{split}.{src}-{tgt}.{lang}.{bin,idx}, dict.{lang}.txt, langs.txt, lang_pairs.txt"),
    ("--model-size", "MODEL_SIZE", "600m", "SIZE", "600m | 1.3b | 3.3b | tiny (default: 600m), "
     "i.e. --arch transformer_nllb_600m | _1_3b | _3_3b | _tiny (tiny: 2+2 layers of 64, for "
     "tests and the CPU demo)"),
    ("--pretrained", "PRETRAINED", "", "CKPT", "stock fairseq checkpoint, or Hugging Face NLLB "
     "model directory / .safetensors file, to start from (--finetune-from-model: weights only; "
     "optimizer, lr schedule and data position start fresh). Default: none, train from "
     "scratch. The NLLB-200 checkpoints need their own SentencePiece model and dictionary: "
     "prepare with --spm-model, --dict and --dict-langs nllb200 (fairseq files) or with "
     "--hf-model DIR (Hugging Face weights)"),
    ("--lang-pairs", "LANG_PAIRS", "", "LIST", "comma-separated SRC-TGT training directions "
     "(default: DATA/lang_pairs.txt)"),
    ("--langs", "LANGS", "", "LIST", "comma-separated languages, in dictionary order (their "
     "__lang__ token ids depend on it; default: DATA/langs.txt)"),
    ("--nproc", "NPROC", "", "N", "processes (ranks) on this machine (default: the number of "
     "GPUs; 2 with --cpu)"),
    ("--save-dir", "SAVE_DIR", "", "DIR", "checkpoints, memory.jsonl (default: "
     "checkpoints/nllb_SIZE)"),
    ("--max-update", "MAX_UPDATE", "10000", "N", "updates to train (default: 10000)"),
    ("--max-tokens", "MAX_TOKENS", "4096", "N", "tokens per batch per rank (default: 4096)"),
    ("--update-freq", "UPDATE_FREQ", "1", "N", "batches accumulated per update (default: 1)"),
    ("--lr", "LR", "5e-5", "LR", "peak learning rate (default: 5e-5, NLLB's fine-tuning lr)"),
    ("--warmup-updates", "WARMUP_UPDATES", "", "N", "inverse_sqrt warm-up from 1e-7 to LR "
     "(default: MAX_UPDATE/10, at most 4000)"),
    ("--root-reshard", "ROOT_RESHARD", "", "MODE", "--fsdp2-root-reshard: always | default "
     "(default: always; default with --speed). always: the root and the shared-embedding unit "
     "reshard after forward and are gathered again (less memory: the 256k x dim embedding is "
     "262M params on the 600M model); default: they stay gathered from forward to backward "
     "(one all-gather of the embedding less per step)"),
    ("--loss-chunk-tokens", "LOSS_CHUNK_TOKENS", "256", "N", "the loss's output projection, "
     "log-softmax and gradients run over chunks of N target tokens in one pass "
     "(label_smoothed_cross_entropy_chunked): the tokens x 256k logits never exist at once "
     "(default: 256); 0: fairseq's label_smoothed_cross_entropy"),
    ("--min-params-to-wrap", "MIN_PARAMS_TO_WRAP", "1", "N", "a transformer layer with >= N "
     "parameters becomes its own FSDP2 unit (default: 1, every layer). NLLB's own recipe used "
     "100000000 (1e8) with fairscale: no NLLB layer is that large (600M: 12.6M encoder / 16.8M "
     "decoder layer), so 1e8 wraps nothing, the whole model is one unit and memory per rank "
     "barely drops"),
    ("--precision", "PRECISION", "", "P", "fp16 | bf16 | fp32 (default: fp16 on GPU, as NLLB's "
     "--memory-efficient-fp16: fp16 compute, fp32 sharded master weights, loss scaling; fp32 "
     "with --cpu)"),
    ("--num-workers", "NUM_WORKERS", "", "N", "data loader worker processes (default: "
     "fairseq's 1 on GPU, 0 on CPU: each worker costs about 5 s to shut down at every "
     "validation and checkpoint, longer than a tiny model's epoch)"),
    ("--lora-rank", "LORA_RANK", "0", "R", "fine-tune low-rank adapters (LoRA) of rank R on the "
     "attention and feed-forward projections, the base frozen in the compute dtype "
     "(docs/lora.md; default: 0, full fine-tuning). --lora-alpha, --lora-dropout, "
     "--lora-modules and --lora-train-params go after --"),
    ("--log-interval", "LOG_INTERVAL", "100", "N", "updates between log lines (default: 100)"),
    ("--seed", "SEED", "2", "N", "(default: 2)"),
)
#: (flag, environment variable, help) of the switches (the variable: 1 on, 0 off)
SWITCHES = (
    ("--cpu", "CPU", "train on CPU (gloo); also --num-workers 0 (see NUM_WORKERS). Default: CPU "
     "when no GPU is visible (nvidia-smi)"),
    ("--speed", "SPEED", "prefer words/s to memory: --root-reshard default unless given. The "
     "chunked loss and the tied-embedding gradient buffer stay on (they cost no speed; "
     "--fsdp2-no-tied-grad-buffer after -- turns the buffer off)"),
    ("--dry-run", "DRY_RUN", "print the torchrun command (shell-quoted, one line on stdout) and "
     "stop: nothing is installed or launched. Its fairseq-train flags are the ones to run under "
     "your own torchrun or srun"),
)
UNSIGNED = ("MAX_UPDATE", "MAX_TOKENS", "UPDATE_FREQ", "MIN_PARAMS_TO_WRAP", "LOG_INTERVAL",
            "SEED", "LOSS_CHUNK_TOKENS", "NPROC", "WARMUP_UPDATES", "NUM_WORKERS", "LORA_RANK")


class Usage(Exception):
    """Bad input: main() prints it as one line and returns 2."""


def die(message: str) -> NoReturn:
    raise Usage(message)


class OneLineParser(argparse.ArgumentParser):
    """Bad input is one line (argparse would print the usage first)."""

    def error(self, message: str) -> NoReturn:
        die(message)


def build_parser() -> argparse.ArgumentParser:
    """The script's options; each takes its default from its environment variable."""
    environ = os.environ
    parser = OneLineParser(
        prog="scripts/finetune_nllb.sh", allow_abbrev=False, description=DESCRIPTION,
        epilog=EPILOG, formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
            prog, max_help_position=24, width=96),
        usage="%(prog)s --data DIR [options] [-- extra fairseq-train flags]")
    for flag, env, default, metavar, text in VALUED:
        parser.add_argument(flag, dest=env, metavar=metavar, default=environ.get(env) or default,
                            help=f"[{env}] {text}")
    for flag, env, text in SWITCHES:
        parser.add_argument(flag, dest=env, action="store_const", const="1",
                            default=environ.get(env, ""), help=f"[{env}=1] {text}")
    return parser


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, and what follows ``--`` (for fairseq-train)."""
    argv = list(argv)
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    opts, unknown = build_parser().parse_known_args(own)
    if unknown:
        die(f"unknown argument '{unknown[0]}' (fairseq-train flags go after --; see --help)")
    return opts, extra


def check(o: argparse.Namespace) -> None:
    """Every check before anything is installed or launched; fills in the derived defaults."""
    if o.MODEL_SIZE not in SIZES:
        die(f"unknown model size '{o.MODEL_SIZE}' (choose 600m, 1.3b, 3.3b or tiny)")
    if not o.DATA:
        die("--data DIR is required (binarized data from scripts/prepare_data.sh)")
    data = Path(o.DATA)
    if not data.is_dir():
        die(f"data directory {o.DATA} does not exist")
    for name in UNSIGNED:
        value = getattr(o, name)
        if value and not re.fullmatch(r"[0-9]+", value):
            die(f"{name} must be a non-negative integer, got '{value}'")
    if o.NPROC and int(o.NPROC) < 1:
        die("NPROC must be >= 1")
    if not re.fullmatch(r"[0-9.]+([eE][-+]?[0-9]+)?", o.LR):
        die(f"LR must be a number, got '{o.LR}'")
    for name in ("SPEED", "DRY_RUN", "CPU"):
        if getattr(o, name) not in ("", "0", "1"):
            die(f"{name} must be 0 or 1, got '{getattr(o, name)}'")
    o.ROOT_RESHARD = o.ROOT_RESHARD or ("default" if o.SPEED == "1" else "always")
    if o.ROOT_RESHARD not in ("default", "always"):
        die(f"unknown root reshard '{o.ROOT_RESHARD}' (choose default or always)")
    if o.PRETRAINED and not os.path.exists(o.PRETRAINED):
        die(f"pretrained checkpoint {o.PRETRAINED} does not exist")
    if o.PRECISION and o.PRECISION not in PRECISION_FLAGS:
        die(f"unknown precision '{o.PRECISION}' (choose fp16, bf16 or fp32)")
    o.LANG_PAIRS = o.LANG_PAIRS or _listed(data, "lang_pairs.txt", "--lang-pairs")
    o.LANGS = o.LANGS or _listed(data, "langs.txt", "--langs")
    if not o.LANG_PAIRS:
        die("the language pair list is empty")
    langs = o.LANGS.split(",")
    for pair in o.LANG_PAIRS.split(","):
        if not re.fullmatch(r"[^-,]+-[^-,]+", pair):
            die(f"malformed language pair '{pair}' (expected SRC-TGT)")
        src, tgt = pair.split("-")
        for lang in (src, tgt):
            if lang not in langs:
                die(f"language {lang} of pair {pair} is not in the language list ({o.LANGS})")
            if not (data / f"dict.{lang}.txt").is_file():
                die(f"{o.DATA} has no dict.{lang}.txt (needed for pair {pair})")
            # fairseq reads a pair's files in either direction: train.src-tgt.* or train.tgt-src.*
            if not any((data / f"train.{a}-{b}.{lang}.idx").is_file()
                       for a, b in ((src, tgt), (tgt, src))):
                die(f"{o.DATA} has no training data for pair {pair} "
                    f"(train.{src}-{tgt}.{lang}.idx/.bin not found)")


def _listed(data: Path, name: str, flag: str) -> str:
    """DATA/name (prepare_data.sh writes it) as a comma-separated list."""
    if not (data / name).is_file():
        die(f"no {flag} given and {data / name} not found")
    return "".join((data / name).read_text().split())


def gpus() -> int:
    """GPUs nvidia-smi lists (0 without nvidia-smi): the default device and rank count."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU") for line in listed.splitlines())


def train_flags(o: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    """fairseq-train's arguments for the recipe (after ``check``, with the device chosen)."""
    warmup = o.WARMUP_UPDATES or str(max(1, min(4000, int(o.MAX_UPDATE) // 10)))
    device = []
    if o.CPU == "1":
        device = ["--cpu", "--num-workers", o.NUM_WORKERS or "0"]
    elif o.NUM_WORKERS:
        device = ["--num-workers", o.NUM_WORKERS]
    chunk = int(o.LOSS_CHUNK_TOKENS)
    loss = (["--criterion", "label_smoothed_cross_entropy_chunked", "--loss-chunk-tokens",
             str(chunk)] if chunk > 0 else ["--criterion", "label_smoothed_cross_entropy"])
    return [
        o.DATA, "--user-dir", str(ROOT / "fairseq_fsdp2"), "--ddp-backend", "fsdp2",
        "--arch", f"transformer_nllb_{o.MODEL_SIZE.replace('.', '_')}",
        *(["--finetune-from-model", o.PRETRAINED] if o.PRETRAINED else []),
        "--task", "translation_multi_simple_epoch", "--lang-pairs", o.LANG_PAIRS,
        "--langs", o.LANGS, "--encoder-langtok", "src", "--decoder-langtok",
        "--max-source-positions", "512", "--max-target-positions", "512",
        "--skip-invalid-size-inputs-valid-test",
        "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-6",
        "--lr", o.LR, "--lr-scheduler", "inverse_sqrt", "--warmup-init-lr", "1e-7",
        "--warmup-updates", warmup, *loss, "--label-smoothing", "0.1",
        "--max-tokens", o.MAX_TOKENS, "--update-freq", o.UPDATE_FREQ,
        "--max-update", o.MAX_UPDATE, "--min-params-to-wrap", o.MIN_PARAMS_TO_WRAP,
        "--fsdp2-root-reshard", o.ROOT_RESHARD, *PRECISION_FLAGS[o.PRECISION], *device,
        *(["--lora-rank", o.LORA_RANK] if int(o.LORA_RANK or 0) > 0 else []),
        "--save-dir", o.SAVE_DIR or f"checkpoints/nllb_{o.MODEL_SIZE}", "--seed", o.SEED,
        "--log-interval", o.LOG_INTERVAL, "--no-progress-bar", *extra]


def say(line: str) -> None:
    print(f"[{PROG}] {line}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command: 2 after one line on stderr for bad input; else it becomes torchrun (or,
    with --dry-run, prints its command and returns 0)."""
    try:
        return _run(sys.argv[1:] if argv is None else argv)
    except Usage as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def _run(argv: Sequence[str]) -> int:
    opts, extra = parse(argv)
    check(opts)
    found = gpus() if opts.CPU != "1" else 0  # nvidia-smi once, and not for --cpu
    opts.CPU = opts.CPU or ("0" if found else "1")
    opts.NPROC = opts.NPROC or ("2" if opts.CPU == "1" else str(found))
    opts.PRECISION = opts.PRECISION or ("fp32" if opts.CPU == "1" else "fp16")
    flags = train_flags(opts, extra)
    bin_dir = ROOT / ".venv" / "bin"
    cmd = [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", opts.NPROC,
           str(bin_dir / "fairseq-train"), *flags]
    if opts.DRY_RUN == "1":
        print(shlex.join(cmd))
        return 0
    subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], check=True)
    # glibc keeps freed memory without this, and RSS-based peak memory (CPU) creeps up
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    device = "CPU" if opts.CPU == "1" else "GPU"
    say(f"{flags[flags.index('--arch') + 1]} on {opts.NPROC} rank(s) ({device}, "
        f"{opts.PRECISION}), {opts.LANG_PAIRS} -> {flags[flags.index('--save-dir') + 1]}")
    say(shlex.join(cmd))
    # the estimator reads the same flags (fairseq's parser); a failure does not stop training
    say("predicted per-rank memory for this command:")
    estimate = subprocess.run([str(bin_dir / "python"), "-m", "fairseq_fsdp2.estimate", *flags,
                               "--world-size", opts.NPROC], stdout=sys.stderr)
    if estimate.returncode != 0:
        say("(no prediction: the estimator failed; training starts anyway)")
    os.execv(cmd[0], cmd)
    return 1  # not reached: execv replaced the process


if __name__ == "__main__":
    sys.exit(main())
