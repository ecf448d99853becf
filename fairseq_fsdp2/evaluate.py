"""Evaluate an NLLB model as NLLB is evaluated: every direction of a test set translated with
NLLB's generation settings, scored with chrF++, spBLEU and BLEU (sacreBLEU, with signatures),
optionally against a baseline (the model fine-tuning started from: the forgetting check).

    python -m fairseq_fsdp2.evaluate DATA MODEL [--baseline BASE] [--directions a-b,c-d]
    python -m fairseq_fsdp2.evaluate DATA MODEL --baseline BASE --max-drop 1 --fail-on-drop

DATA: a directory written by scripts/prepare_data.sh. MODEL, BASE: a checkpoint (sharded,
consolidated, stock fairseq, LoRA), a Hugging Face NLLB directory or a CTranslate2 directory.
Everything is checked before any generation: bad input is one line, exit status 2. Under
torchrun the ranks share the directions. The work: evaluation/.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import PROG, FSDP2Error, prints_bad_input, report_bad_input, unwritable
from .evaluation import generation, inputs, models as model_sources, ranks, report, runner, \
    scores


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fairseq_fsdp2.evaluate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="the data directory (scripts/prepare_data.sh's DEST)")
    p.add_argument("model", help="a checkpoint file (sharded, consolidated, stock fairseq, "
                   "LoRA) or a CTranslate2 model directory")
    p.add_argument("--baseline", help="a second model scored on the same sets (the model "
                   "fine-tuning started from); the table shows the differences")
    p.add_argument("--split", default="test", help="the split to translate (default: test)")
    p.add_argument("--directions", help="comma-separated SRC-TGT directions (default: every "
                   "language pair the data was prepared with that has the split)")
    p.add_argument("--raw", help="a directory of raw text files {split}.{src}-{tgt}.{lang} "
                   "(data preparation's input): sources and references from them, as NLLB "
                   "scores against the text files (default: the binarized split, decoded)")
    p.add_argument("--out", default="evaluation", help="where hypotheses, references, "
                   "results.json (and the chart) go (default: ./evaluation)")
    g = generation.Generation()
    p.add_argument("--beam", type=int, default=g.beam, help="beam size (NLLB: 4)")
    p.add_argument("--lenpen", type=float, default=g.lenpen, help="length penalty (NLLB: 1)")
    p.add_argument("--max-len-a", type=float, default=g.max_len_a,
                   help="maximum length a*source+b: a (NLLB: 0)")
    p.add_argument("--max-len-b", type=int, default=g.max_len_b, help="... b (NLLB: 200)")
    p.add_argument("--batch-size", type=int, default=g.batch_size,
                   help="sentences per batch (NLLB: 50)")
    p.add_argument("--precision", choices=("auto", "float32", "float16", "bfloat16"),
                   default="auto", help="auto: float16 on a GPU (as NLLB evaluates), float32 "
                   "on the CPU")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--spbleu-model", help="the FLORES-200 SentencePiece model for spBLEU "
                   "(sacreBLEU's flores200 tokenizer, offline); default: sacreBLEU's downloaded "
                   "copy ($SACREBLEU/models/flores200sacrebleuspm) if there is one, else no "
                   "spBLEU. Another SentencePiece model is named by its hash in the signature")
    p.add_argument("--max-drop", type=float, default=1.0, help="with --baseline: mark the "
                   "directions whose chrF++ fell by more than this many points (default: 1)")
    p.add_argument("--fail-on-drop", action="store_true",
                   help="with --baseline: exit status 1 when a direction dropped")
    p.add_argument("--plot", nargs="?", const="", metavar="PNG",
                   help="also draw per-direction bars (baseline against model) to PNG "
                   "(default: OUT/scores.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _check_output(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise FSDP2Error(f"cannot write {out}: it is a file")
    problem = unwritable(str(out))
    if problem:
        raise FSDP2Error(f"cannot write {out}: {problem}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    try:  # every check before any generation
        _check_output(out)
        plot = None if args.plot is None else Path(args.plot or out / "scores.png")
        if plot is not None:
            _check_output(plot.parent)
        if args.fail_on_drop and not args.baseline:
            raise FSDP2Error("--fail-on-drop needs --baseline")
        if args.beam < 1 or args.batch_size < 1:
            raise FSDP2Error("--beam and --batch-size must be at least 1")
        if args.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise FSDP2Error("--device cuda: no CUDA device here")
        test = inputs.test_set(Path(args.data), args.split,
                               args.directions.split(",") if args.directions else None,
                               Path(args.raw) if args.raw else None)
        if args.spbleu_model is not None and not os.path.isfile(args.spbleu_model):
            raise FSDP2Error(f"--spbleu-model {args.spbleu_model} does not exist")
        spm = scores.spbleu_model(args.spbleu_model)
        chosen = {report.MODEL: model_sources.model_source(args.model, "model",
                                                           test.dictionary)}
        if args.baseline:
            chosen[report.BASELINE] = model_sources.model_source(args.baseline, "baseline",
                                                                 test.dictionary)
        gen = generation.Generation(args.beam, args.lenpen, args.max_len_a, args.max_len_b,
                                    args.batch_size, args.precision, args.device)
        if any(m.kind == "ctranslate2" for m in chosen.values()):
            from .evaluation.ctranslate2_export import check_compute
            check_compute(gen)
    except FSDP2Error as e:  # every rank finds it; one per machine says it
        return report_bad_input(PROG, e) if prints_bad_input() else 2
    scorer = scores.Scorer(*spm)
    out.mkdir(parents=True, exist_ok=True)
    shared = ranks.from_environment()
    if shared.world > 1 and gen.resolved().device == "cuda":
        import torch
        torch.cuda.set_device(shared.local_rank)
    try:
        results = shared.gather(runner.evaluate(
            test, chosen, gen, scorer, out, show_progress=not args.no_progress,
            log=lambda line: print(line, file=sys.stderr),
            directions=shared.mine(test.directions)), [d.name for d in test.directions])
    finally:
        ranks.close(shared)
    dropped = [r.direction for r in results if args.baseline and r.dropped(args.max_drop)]
    code = 1 if dropped and args.fail_on_drop else 0
    if shared.rank == 0:
        write_report(args, out, plot, test, chosen, gen, scorer, spm, results)
        if code:
            print(f"{PROG}: {len(dropped)} direction(s) dropped by more than "
                  f"{args.max_drop:g} chrF++: {', '.join(dropped)}", file=sys.stderr)
    return code


def write_report(args, out, plot, test, chosen, gen, scorer, spm, results) -> None:
    """The table and signatures on stdout, results.json, the chart."""
    print(report.table(results, args.max_drop))
    if spm[0] is None:
        print("\nspBLEU: not computed (no FLORES-200 SentencePiece model: --spbleu-model FILE)")
    meta = runner.meta(test, chosen, gen, scorer, generation.SETTINGS_SOURCE, spm)
    report.write_json(out / "results.json", results, meta, args.max_drop)
    print(f"\nsignatures: " + "; ".join(f"{scores.LABELS[k]}: {v}" for k, v in
                                          scorer.signatures().items() if v))
    print(f"results: {out / 'results.json'}")
    if plot is not None:
        base = Path(args.baseline or "").name
        report.plot(plot, results, {report.MODEL: f"model ({Path(args.model).name})",
                                    report.BASELINE: f"baseline ({base})"})
        print(f"chart: {plot}")


if __name__ == "__main__":
    import logging
    import warnings

    from .process import quiet
    quiet.no_debug_log()
    logging.getLogger("fairseq").setLevel(logging.WARNING)  # its per-direction loading notes
    # fairseq's batch iterator asks for pinned memory on a machine without an accelerator
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true")
    sys.exit(main())
