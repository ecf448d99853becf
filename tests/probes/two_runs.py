"""A Python program run as 2 ranks (torchrun's environment) that trains twice in-process, the
second run with other settings, as a sweep driver under torchrun does: after each run it prints
``RUN <n> <json>`` (the process's state); tests/test_in_process.py reads it.

argv: the fairseq-train arguments of the first run (ending in ``--save-dir DIR``); the second
adds ``--encoder-layers 1`` and saves in ``DIR-second``.
"""
import json
import sys
import threading

import torch.distributed as dist

import fairseq_fsdp2  # noqa: F401  (the in-process way: the plugin imported first)
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from fairseq_cli import train

from fairseq_fsdp2.process import run_context


def train_run(args) -> None:
    parsed = options.parse_args_and_arch(options.get_training_parser(), args)
    distributed_utils.call_main(convert_namespace_to_omegaconf(parsed), train.main)


def main() -> None:
    args = sys.argv[1:]
    for n, extra in enumerate([[], ["--encoder-layers", "1", "--save-dir", f"{args[-1]}-second"]]):
        train_run([*args, *extra])
        print(f"RUN {n} " + json.dumps({
            "group": dist.is_initialized(), "run": run_context.current() is not None,
            "threads": sorted(t.name for t in threading.enumerate()
                              if t.name.startswith("fsdp2"))}), flush=True)


if __name__ == "__main__":
    main()
