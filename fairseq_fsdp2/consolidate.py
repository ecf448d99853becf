"""Consolidated export: a sharded FSDP2 checkpoint, or legacy FSDP's (fairscale)
``--use-sharded-state`` shard files, -> one stock fairseq checkpoint file (or, with ``--format
hf``, a Hugging Face NLLB model directory).

    python -m fairseq_fsdp2.consolidate CHECKPOINT OUT.pt
    python -m fairseq_fsdp2.consolidate --ema CHECKPOINT OUT.pt   # its EMA as the model
    python -m fairseq_fsdp2.consolidate --format peft CHECKPOINT OUT_DIR   # LoRA's adapters
    python -m fairseq_fsdp2.consolidate --format ctranslate2 --quantization int8 CHECKPOINT OUT

The export itself: checkpoint/export.py (CTranslate2: evaluation/ctranslate2_export.py).
"""
from __future__ import annotations

import argparse
import os
import sys

from .checkpoint.export import consolidate
from .errors import CheckpointError, unwritable
from .process import quiet


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fairseq_fsdp2.consolidate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint file saved by --ddp-backend fsdp2, or "
                        "legacy FSDP's NAME-shard0.pt (or NAME.pt) from --use-sharded-state")
    parser.add_argument("out", help="the consolidated .pt file to write (with --format hf: the "
                        "model directory to write; it must not exist or be empty)")
    parser.add_argument("--format", choices=("fairseq", "hf", "peft", "ctranslate2"),
                        default="fairseq",
                        help="fairseq: one stock fairseq checkpoint file; hf: a Hugging Face "
                        "NLLB model directory (config.json, model.safetensors, and the "
                        "tokenizer files of DATA/hf_tokenizer when the data has them) that "
                        "transformers' M2M100ForConditionalGeneration.from_pretrained loads "
                        "(a LoRA checkpoint: its adapters merged); peft: a --lora-rank "
                        "checkpoint's adapters as a PEFT adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) for peft.PeftModel.from_pretrained on the "
                        "base model in Hugging Face format; ctranslate2: a CTranslate2 model "
                        "directory (ctranslate2.Translator, with the SentencePiece model, "
                        "nllb.json and a README saying how to translate)")
    parser.add_argument("--quantization", choices=("int8", "int8_float16", "int8_float32",
                                                   "float16", "bfloat16", "float32"),
                        default="float32", help="--format ctranslate2: the weights' format "
                        "(int8: CPU serving; float16 / int8_float16: GPU)")
    parser.add_argument("--ema", action="store_true",
                        help="export the EMA of a --store-ema run as the model (fairseq or "
                        "--format hf); CHECKPOINT may also be a stock fairseq checkpoint with one")
    parser.add_argument("--data", help="the data directory, if it is no longer where the "
                        "checkpoint's cfg says: legacy FSDP shards build the model from it; "
                        "--format hf takes the tokenizer files from its hf_tokenizer folder "
                        "(written by scripts/prepare_data.sh --hf-model)")
    args = parser.parse_args(argv)
    if os.path.abspath(args.out) == os.path.abspath(args.checkpoint):
        print("fairseq_fsdp2: error: OUT must differ from CHECKPOINT", file=sys.stderr)
        return 2
    parent = os.path.dirname(os.path.abspath(args.out))  # checked before anything is read
    problem = unwritable(parent) or (None if os.path.isdir(parent) else f"{parent} does not "
                                                                        f"exist")
    if problem:
        print(f"fairseq_fsdp2: error: cannot write {args.out}: {problem}", file=sys.stderr)
        return 2
    if args.format == "ctranslate2" and args.ema:
        print("fairseq_fsdp2: error: --ema: export the EMA with --format fairseq first, then "
              "that file with --format ctranslate2", file=sys.stderr)
        return 2
    try:
        if args.format == "ctranslate2":
            from .evaluation.ctranslate2_export import export
            export(args.checkpoint, args.out, args.data, args.quantization)
        else:
            consolidate(args.checkpoint, args.out, args.data, args.format, ema=args.ema)
    except CheckpointError as e:
        print(f"fairseq_fsdp2: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the write failed (a full disk: checkpoint/export.py says so)
        print(f"fairseq_fsdp2: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    import logging
    quiet.no_debug_log()
    logging.getLogger("fairseq").setLevel(logging.WARNING)  # --format ctranslate2's task notes
    sys.exit(main())
