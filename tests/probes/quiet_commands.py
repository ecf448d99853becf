"""Several ``python -m MODULE ARGS`` commands, one after another, in one fresh interpreter (test
code, not plugin code): ``python -m quiet_commands MODULE ARGS... :: MODULE ARGS...``.

Each command starts from the state ``python -m MODULE`` would give it: the package
(``fairseq_fsdp2``) is imported first, as ``-m`` imports a module's package before running it
(and with it fairseq, whose import sets logging's root to DEBUG); that state of logging (every
logger's level, handlers, propagation and disabled flag) and of the warning filters is taken
then and put back before each command, so a command that leaves logging at INFO cannot hide a
later command's debug lines (putting the filters back also empties every module's record of
warnings already shown, so a warning is shown again). What stays from an earlier command: the
modules it imported (their import-time warnings were printed in its part of the output, which
the tests read whole). After each command one line ``=== quiet_commands: MODULE exit CODE ===``.
"""
import logging
import runpy
import sys
import warnings

import fairseq_fsdp2  # noqa: F401  (what `python -m fairseq_fsdp2.X` imports first)

MARK = "=== quiet_commands: {} exit {} ==="


def _logging_state() -> dict:
    loggers = [logging.root] + [v for v in logging.Logger.manager.loggerDict.values()
                                if isinstance(v, logging.Logger)]
    return {lg: (lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers}


def _restore(state: dict, filters: list) -> None:
    for lg, (level, handlers, propagate, disabled) in state.items():
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate, lg.disabled = propagate, disabled
    warnings.resetwarnings()  # empties the filters and marks them changed (registries reset)
    warnings.filters.extend(filters)


def main(argv: list) -> int:
    commands, current = [], []
    for a in argv:
        if a == "::":
            commands.append(current)
            current = []
        else:
            current.append(a)
    commands.append(current)
    state, filters = _logging_state(), list(warnings.filters)
    for module, *args in commands:
        _restore(state, filters)
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        print(MARK.format(module, code), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
