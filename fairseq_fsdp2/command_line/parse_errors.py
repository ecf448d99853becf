"""fairseq's command-line parse errors in one line (integration/registration.py's patch 5).

argparse answers a bad flag value (``--fsdp2-root-reshard sometimes``), an unknown flag or a
missing argument with fairseq's whole usage, about 120 lines, before the error itself. FSDP2 runs
(the last ``--ddp-backend`` is ``fsdp2`` or ``fully_sharded``), and any run with a bad value of
one of the plugin's own flags, get the error alone, as every other bad input:
``fairseq_fsdp2: error: argument --fsdp2-root-reshard: invalid choice: 'sometimes' (choose from
'default', 'always')``, exit status 2, printed by one rank per machine (errors.prints_bad_input),
where a fairseq command parses its command line (cli.stop decides: cli.in_fairseq_command);
a Python program that parses a list gets the OptionError. Runs of other backends keep stock
fairseq's output; FAIRSEQ_FSDP2_DEBUG=1 too.
"""
from __future__ import annotations

import os
import re
import sys
from typing import NoReturn, Sequence

from ..errors import DEBUG_ENV, OptionError
from ..options import PLUGIN_OPTIONS, SERVED_BACKENDS
from .exits import in_fairseq_command, owns_process
from .exits import stop as stop_with

#: the plugin's own flags (options.PLUGIN_OPTIONS as argparse spells them)
PLUGIN_FLAGS = frozenset("--" + key.replace("_", "-") for key in PLUGIN_OPTIONS)


def asks_for_fsdp2(argv: Sequence[str]) -> bool:
    """Whether a fairseq command line trains with FSDP2: its last ``--ddp-backend`` (the one
    argparse keeps; scripts/train.sh puts its own first) is fsdp2 or fully_sharded."""
    backend = None
    for flag, value in zip(argv, [*argv[1:], None]):
        if flag == "--ddp-backend":
            backend = value
        elif flag.startswith("--ddp-backend="):
            backend = flag.split("=", 1)[1]
    return backend in SERVED_BACKENDS


def names_plugin_flag(message: str) -> bool:
    """Whether argparse's error message is about one of the plugin's flags."""
    found = re.match(r"argument ([^:]+):", message)
    return bool(found) and any(flag in PLUGIN_FLAGS for flag in found.group(1).split("/"))


def one_line(argv: Sequence[str], message: str) -> bool:
    """Whether argparse's error ``message`` for command line ``argv`` is reported in one line."""
    return not os.environ.get(DEBUG_ENV) and (asks_for_fsdp2(argv) or names_plugin_flag(message))


def stop(message: str) -> NoReturn:
    """Bad input: in a fairseq command, one line (on one rank per machine) and exit status 2,
    as argparse's own error would end it; elsewhere (a program parsing a list) an
    OptionError."""
    stop_with(OptionError(message), owns_process() or in_fairseq_command())


def check_not_loaded_mid_parse(stock_parse_code) -> None:
    """Raise OptionError if the plugin is being loaded by ``--user-dir`` from inside fairseq's
    stock ``parse_args_and_arch`` (``stock_parse_code``: its code object) given a list that asks
    for FSDP2. fairseq-train imports ``--user-dir`` from its own command line before it builds
    the parser; a program that builds ``options.get_training_parser()`` and passes
    ``["--user-dir", "fairseq_fsdp2", "--ddp-backend", "fsdp2", ...]`` has a parser built
    before the plugin was loaded, whose choices and options cannot know it ("invalid choice:
    'fsdp2'", argparse's usage and exit). Say the fix instead. Frames are walked with
    CPython's ``sys._getframe`` (no public way to see the caller's arguments)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not stock_parse_code:
        frame = frame.f_back
    if frame is None or frame.f_locals.get("input_args") is None:
        return
    if asks_for_fsdp2([str(a) for a in frame.f_locals["input_args"]]):
        raise OptionError(
            "fairseq built this parser before --user-dir loaded fairseq_fsdp2, so it does not "
            "know --ddp-backend fsdp2 or the plugin's options: import fairseq_fsdp2 before "
            "options.get_training_parser() (docs/launching.md, \"Training from Python\")")


def parse_args_and_arch(fairseq_parse, parser, input_args=None, *args, **kwargs):
    """Stand-in for fairseq's ``options.parse_args_and_arch``: the same, with ``parser``'s
    errors in one line where ``one_line`` says so, and for FSDP2 runs the real conflict behind
    fairseq's parse-time "Cannot combine --fp16 and --tpu" (fairseq turns --bf16 into --tpu)."""
    argv = sys.argv[1:] if input_args is None else [str(a) for a in input_args]
    stock_error = parser.error

    def error(message: str):
        if not one_line(argv, message):
            stock_error(message)
        stop(message)

    parser.error = error  # argparse reports through self.error
    try:
        return fairseq_parse(parser, input_args, *args, **kwargs)
    except ValueError as e:
        if "Cannot combine --fp16 and --tpu" not in str(e) or not asks_for_fsdp2(argv) \
                or os.environ.get(DEBUG_ENV):
            raise
        stop("--fp16 and --bf16 are mutually exclusive: choose one" if any(
            a in argv for a in ("--bf16", "--memory-efficient-bf16"))
            else "--tpu cannot be combined with --ddp-backend fsdp2")
    finally:
        del parser.error
