"""A Python program that drives fairseq in-process with the plugin, as a notebook, a sweep
driver or fairseq's own test helpers do (``distributed_utils.call_main(cfg, main)``), all in one
process and inside a ``tempfile.TemporaryDirectory``:

train (1 rank, 4 updates) -> validate and generate from its checkpoint with fairseq's own mains
-> train again, resuming to update 6 -> an uninterrupted 6-update run (the resume's reference:
the two consolidated exports compared bit for bit)
-> another config (background saves, the root resharded, one encoder layer, bf16 moments:
the stochastic rounding's kept buffers) -> a run with a missing data directory and one with a
broken checkpoint, each caught as an FSDP2Error.

It prints ``PHASE <name> <json>`` after each step (the process's state then) and ``DONE`` at the
end; an ``atexit`` handler prints ``ATEXIT`` at interpreter exit. fairseq's own log lines (the
``train_inner`` records) come between the phase lines. tests/test_in_process.py reads it all.

argv[1]: a JSON object: ``corpus``, ``model`` (the tiny model's flags), ``training``.
"""
import atexit
import json
import os
import signal
import sys
import tempfile
import threading
import warnings

import torch
import torch.distributed as dist

import fairseq_fsdp2  # noqa: F401  (the in-process way: the plugin imported first)
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from fairseq_cli import generate, train, validate

from fairseq_fsdp2.errors import FSDP2Error
from fairseq_fsdp2.launch import run_context
from fairseq_fsdp2.optimizer.blockwise_8bit import kept_bytes


def state() -> dict:
    """What a run must leave as it found it."""
    return {"sigterm": str(signal.getsignal(signal.SIGTERM)),
            "filters": [repr(f) for f in warnings.filters],
            "group": dist.is_initialized(),
            "threads": sorted(t.name for t in threading.enumerate()
                              if t.name.startswith("fsdp2")),
            "run": run_context.current() is not None,
            "kept_buffers": kept_bytes()}  # this (the main) thread's, where the steps ran


def phase(name: str, **extra) -> None:
    print(f"PHASE {name} " + json.dumps({**state(), **extra}), flush=True)


def parsed(parser, args):
    return convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, list(map(str, args))))


def fairseq_caches_its_global_group() -> bool:
    """Whether fairseq's get_global_group keeps its group where the run context drops it."""
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0)
    try:
        group = distributed_utils.get_global_group()
        cached = getattr(distributed_utils.get_global_group, run_context.FAIRSEQ_GROUP_CACHE,
                         None) is group
        delattr(distributed_utils.get_global_group, run_context.FAIRSEQ_GROUP_CACHE)
        return cached
    finally:
        dist.destroy_process_group()


def train_run(args) -> None:
    distributed_utils.call_main(parsed(options.get_training_parser(), args), train.main)


def caught(args) -> dict:
    try:
        train_run(args)
    except FSDP2Error as e:
        return {"type": type(e).__name__, "message": str(e), "exit_status": e.exit_status}
    return {"type": None}


def main() -> None:
    spec = json.loads(sys.argv[1])
    atexit.register(print, "ATEXIT", flush=True)
    phase("start", fairseq_caches_group=fairseq_caches_its_global_group())
    corpus = spec["corpus"]
    common = [corpus, *spec["model"], *spec["training"], "--ddp-backend", "fsdp2",
              "--min-params-to-wrap", "1", "--num-workers", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        first = os.path.join(tmp, "first")
        train_run([*common, "--max-update", 4, "--save-dir", first])
        phase("train")
        checkpoint = os.path.join(first, "checkpoint_last.pt")
        distributed_utils.call_main(parsed(options.get_validation_parser(), [
            corpus, "--path", checkpoint, "--task", "translation", "--valid-subset", "valid",
            "--max-tokens", 500, "--cpu", "--num-workers", 0]), validate.main)
        phase("validate")
        results = os.path.join(tmp, "generated")
        distributed_utils.call_main(parsed(options.get_generation_parser(), [
            corpus, "--path", checkpoint, "--task", "translation", "--gen-subset", "valid",
            "--beam", 2, "--max-tokens", 500, "--cpu", "--num-workers", 0,
            "--results-path", results]),
            generate.main)
        with open(os.path.join(results, "generate-valid.txt")) as f:
            hypotheses = sum(line.startswith("H-") for line in f)
        phase("generate", hypotheses=hypotheses)
        train_run([*common, "--max-update", 6, "--save-dir", first])
        phase("resume")
        reference = os.path.join(tmp, "reference")
        train_run([*common, "--max-update", 6, "--save-dir", reference])
        resumed, uninterrupted = (torch.load(os.path.join(d, "checkpoint_last_consolidated.pt"),
                                             weights_only=True)["model"]
                                  for d in (first, reference))
        phase("reference", same_weights=resumed.keys() == uninterrupted.keys() and all(
            torch.equal(resumed[k], uninterrupted[k]) for k in resumed))
        other = os.path.join(tmp, "other")
        train_run([*common, "--max-update", 4, "--save-dir", other, "--encoder-layers", 1,
                   "--write-checkpoints-asynchronously", "--save-interval-updates", 2,
                   "--fsdp2-root-reshard", "always", "--bf16-adam-stats"])
        phase("other", consolidated=os.path.isfile(
            os.path.join(other, "checkpoint_last_consolidated.pt")))
        missing = caught([*common, "--max-update", 2, "--save-dir", os.path.join(tmp, "m"),
                          "--source-lang", "xx", "--target-lang", "yy"])
        phase("missing-data", error=missing, save_dir=os.path.exists(os.path.join(tmp, "m")))
        broken = os.path.join(tmp, "broken.pt")
        with open(broken, "w") as f:
            f.write("not a checkpoint\n")
        failed = caught([*common, "--max-update", 2, "--save-dir", os.path.join(tmp, "b"),
                         "--restore-file", broken])
        phase("broken-checkpoint", error=failed)
        train_run([*common, "--max-update", 2, "--save-dir", os.path.join(tmp, "after")])
        phase("after-failures")
        phase("end", tmp_exists=os.path.isdir(tmp))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
