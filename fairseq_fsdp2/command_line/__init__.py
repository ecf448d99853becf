"""A command line's checks and its one-line errors: bad input found before work or recognised
when fairseq trips over it (preflight.py), fairseq's parse errors in one line (parse_errors.py),
the whole command line checked in one process before torchrun starts the ranks
(before_torchrun.py, for scripts/train.sh), and where an error ends a command: one line and an
exit status, only where the plugin owns the process (exits.py)."""
