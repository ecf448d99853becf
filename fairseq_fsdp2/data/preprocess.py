"""fairseq-preprocess (``fairseq_cli.preprocess``) run in this process.

Why not ``python -m fairseq_cli.preprocess`` in a subprocess: each fresh interpreter spends about
5 s importing torch and fairseq before it binarizes anything; data preparation runs it once per
language pair, the tests several times. Running fairseq's own ``main`` here is the same program
on the same arguments, parsed by fairseq's preprocessing parser.

Two things fairseq's module does to its host process are kept out: importing it calls
``logging.basicConfig`` (the root logger printing INFO to stdout) when the root logger has no
handler yet, and each ``main`` adds a file handler (``DESTDIR/preprocess.log``) to its logger that
is never removed. Here the import sees a handler (a NullHandler, removed again), the logger's
lines stay out of the caller's output, and the file handler is closed after the run (the log
file is written as before).
"""
from __future__ import annotations

import logging
from typing import Sequence

LOGGER = "fairseq_cli.preprocess"


class PreprocessError(Exception):
    """fairseq-preprocess failed; the message is its error."""


def _import_quietly():
    root = logging.getLogger()
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)  # basicConfig does nothing while the root has a handler
    try:
        import fairseq_cli.preprocess as module
    finally:
        root.removeHandler(placeholder)
    return module


def run_preprocess(argv: Sequence[str]) -> None:
    """``fairseq-preprocess ARGV``; raises PreprocessError on failure (bad arguments included)."""
    from fairseq import options

    module = _import_quietly()
    try:
        args = options.get_preprocessing_parser().parse_args(list(map(str, argv)))
    except SystemExit as exc:  # argparse already printed its usage line
        raise PreprocessError(f"bad arguments (exit status {exc.code})") from None
    log = logging.getLogger(LOGGER)
    handlers, propagate = list(log.handlers), log.propagate
    log.propagate = False  # its INFO lines: only into DESTDIR/preprocess.log, as in a subprocess
    try:
        module.main(args)
    except Exception as exc:  # noqa: BLE001  (fairseq raises what it raises; keep its message)
        raise PreprocessError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for handler in log.handlers[len(handlers):]:
            log.removeHandler(handler)
            handler.close()
        log.propagate = propagate
