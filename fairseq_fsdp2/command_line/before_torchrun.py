"""``python -m fairseq_fsdp2.command_line.before_torchrun NPROC FAIRSEQ_TRAIN_ARGS...``: the
command line checked in one process before torchrun starts the ranks (scripts/train.sh).

Under torchrun every rank would find the same bad input, and torchrun's agent would then report
the failed workers (its ``ChildFailedError``, about 60 lines). Checked here first, bad options
stop with one line and exit status 2 before torchrun starts: fairseq's parse errors
(parse_errors.py), the plugin's options and fairseq's flags at world size NPROC
(preflight.check_options) and the launch checks that need no process group (--save-dir
writable, --finetune-from-model there). Nothing is written. What only the ranks can find (the
data, a checkpoint's contents) they still report, one rank per machine. Runs of other backends
are left to fairseq.
"""
from __future__ import annotations

import sys
import warnings
from typing import Optional, Sequence

from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from ..errors import PROG, FSDP2Error, report_bad_input
from . import parse_errors, preflight


def main(argv: Optional[Sequence[str]] = None) -> int:
    """0 when the command line passes; bad input: its one line on stderr, and 2 returned (the
    ``__main__`` block exits with it; in a program, the caller's to act on)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    world_size, train_args = int(argv[0]), [str(a) for a in argv[1:]]
    try:
        args = options.parse_args_and_arch(options.get_training_parser(), train_args)
        if not parse_errors.asks_for_fsdp2(train_args):
            return 0
        with warnings.catch_warnings():  # hydra's deprecation notes: the ranks print them anyway
            warnings.simplefilter("ignore")
            cfg = convert_namespace_to_omegaconf(args)
        preflight.trains_with_fsdp2(cfg)  # the backend flags settled as the ranks settle them
        cfg.distributed_training.distributed_world_size = world_size
        preflight.check_options(cfg)
        preflight.check_launch(cfg, launched_per_rank=True, on_cuda=False)
    except FSDP2Error as e:  # the plugin's checks, and fairseq's parse errors (parse_errors.py)
        return report_bad_input(PROG, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
