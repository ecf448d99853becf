"""A Python program that drives fairseq in-process with the plugin, as a notebook, a sweep
driver or fairseq's own test helpers do (``distributed_utils.call_main(cfg, main)``), all in one
process and inside a ``tempfile.TemporaryDirectory``:

train (1 rank, 6 updates, saving at update 4 too) -> validate and generate from its checkpoint
with fairseq's own mains -> train again, resuming its update-4 save to update 6 (the first run is
the resume's uninterrupted reference: the two consolidated exports compared bit for bit)
-> another config (background saves, the root resharded, one encoder layer, bf16 moments:
the stochastic rounding's kept buffers) -> a run with a missing data directory and one with a
broken checkpoint, each caught as an FSDP2Error -> a run in a process group the program opened itself (with --heartbeat-timeout, which the run sets on
that group, and 8-bit moments, whose buffers and tables the run keeps), the state before and
after it recorded while the group is still open.

It prints ``PHASE <name> <json>`` after each step (the process's state then) and ``DONE`` at the
end; an ``atexit`` handler prints ``ATEXIT`` at interpreter exit. fairseq's own log lines (the
``train_inner`` records) come between the phase lines. tests/test_in_process.py reads it all.

argv[1]: a JSON object: ``corpus``, ``model`` (the tiny model's flags), ``training``.
"""
import atexit
import json
from datetime import timedelta
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
from fairseq_fsdp2.process import run_context
from fairseq_fsdp2.optimizer.moments import blockwise_8bit

#: the collective timeout of the program's own process group (the run sets 30 s on it)
CALLER_TIMEOUT = timedelta(seconds=1234)


def collective_timeouts() -> list:
    """The seconds of each backend's collective timeout of the default group (none: [])."""
    if not dist.is_initialized():
        return []
    group = dist.group.WORLD
    backends = {id(b): b for b in (group._get_backend(d) for d in group._device_types)}
    return sorted(b.options._timeout.total_seconds() for b in backends.values())


def state() -> dict:
    """What a run must leave as it found it."""
    return {"sigterm": str(signal.getsignal(signal.SIGTERM)),
            "filters": [repr(f) for f in warnings.filters],
            "group": dist.is_initialized(),
            "threads": sorted(t.name for t in threading.enumerate()
                              if t.name.startswith("fsdp2")),
            "run": run_context.current() is not None,
            # the process group's collective timeout, torch.load's allow-list, the 8-bit and
            # bf16 moments' kept buffers (every thread's) and tables, the CUDA device, fairseq's
            # cached global group
            "timeouts": collective_timeouts(),
            "safe_globals": sorted(map(str, torch.serialization.get_safe_globals())),
            "moments": blockwise_8bit.kept_state(),
            "cuda_device": torch.cuda.current_device() if torch.cuda.is_initialized() else None,
            "fairseq_group_cache": hasattr(distributed_utils.get_global_group,
                                           run_context.FAIRSEQ_GROUP_CACHE)}


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
        # 6 updates, saved at 4 too: the resume below starts from that save, and this run is
        # its uninterrupted reference (once a third run of 6 updates after the resume)
        train_run([*common, "--max-update", 6, "--save-interval-updates", 4, "--save-dir", first])
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
            "--max-len-a", 0, "--max-len-b", 20,  # conftest.SHORT_GENERATION says why
            "--results-path", results]),
            generate.main)
        with open(os.path.join(results, "generate-valid.txt")) as f:
            hypotheses = sum(line.startswith("H-") for line in f)
        phase("generate", hypotheses=hypotheses)
        resumed_dir = os.path.join(tmp, "resumed")
        train_run([*common, "--max-update", 6, "--save-dir", resumed_dir,
                   "--restore-file", os.path.join(first, "checkpoint_1_4.pt")])
        resumed, uninterrupted = (torch.load(os.path.join(d, "checkpoint_last_consolidated.pt"),
                                             weights_only=True)["model"]
                                  for d in (resumed_dir, first))
        phase("resume", same_weights=resumed.keys() == uninterrupted.keys() and all(
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
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0,
                                timeout=CALLER_TIMEOUT)  # the program's own group
        before = state()
        train_run([*common, "--max-update", 2, "--save-dir", os.path.join(tmp, "after"),
                   "--heartbeat-timeout", 30, "--eight-bit-adam-stats",
                   "--encoder-ffn-embed-dim", 128])  # fc1, fc2: 4096 elements, 8-bit moments
        after = state()
        dist.destroy_process_group()
        phase("after-failures", caller_group={"before": before, "after": after})
        phase("end", tmp_exists=os.path.isdir(tmp))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
