"""Translation speed on the CPU: fairseq's generator (the evaluation's, which is fairseq-generate's
code path) against CTranslate2 exports (float32, int8), the same test set, beam and thread count,
one after the other in this process. A benchmark for docs/benchmarks.md, not a test.

    python scripts/benchmark_ctranslate2.py DATA CHECKPOINT CT2_DIR... [--beam 4] [--threads 1]

Each model translates every direction of DATA's test split once to warm up, then --repeat times;
the best time counts (sentences per second over all directions).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("models", nargs="+", help="a checkpoint file or CTranslate2 directories")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # CTranslate2 reads it at load
    import logging
    import warnings

    import torch
    torch.set_num_threads(args.threads)
    import fairseq_fsdp2  # noqa: F401  (fairseq imported: its loggers exist)
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true")
    from fairseq_fsdp2.evaluation import inputs, models, runner
    from fairseq_fsdp2.evaluation.generation import Generation
    test = inputs.test_set(Path(args.data))
    gen = Generation(beam=args.beam, device="cpu")
    n = None
    print(f"| model | kind | sentences/s (beam {args.beam}, {args.threads} thread(s)) |")
    print("|---|---|---|")
    for path in args.models:
        source = models.model_source(path, Path(path).name, test.dictionary)
        translator = runner.translator(source, test, gen)
        best = float("inf")
        for attempt in range(args.repeat + 1):  # the first warms up (and loads the model)
            start = time.perf_counter()
            n = sum(len(translator.translate(d).hypotheses) for d in test.directions)
            if attempt:
                best = min(best, time.perf_counter() - start)
        print(f"| {Path(path).name} | {source.kind} | {n / best:.1f} |")
    print(f"\n{n} sentences ({', '.join(d.name for d in test.directions)}), {test.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
