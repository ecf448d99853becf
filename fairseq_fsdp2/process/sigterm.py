"""SIGTERM: one line that says who stopped the run and what happens next.

torchrun's agent stops the other workers this way about 0.1 s after one fails; SLURM does on
``scancel`` or at the time limit. Instead of whatever the signal interrupts, the rank prints one
line and ends by the signal, so that the launcher sees what it sent.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable, Optional

from .torchrun import restart_count, under_torchrun_agent


def sigterm_handler(rank: int, save_dir: Optional[str], updates: Callable[[], Optional[int]]):
    """A SIGTERM handler that prints one line (who stopped the run, where, what happens next),
    then ends the process by the signal as before, so that the launcher sees what it sent. The
    run context installs it for the run and restores the previous handler (run_context.py)."""
    pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() == pid:  # not a forked data-loader worker
            try:
                sys.stdout.flush()
            except Exception:  # the signal interrupted a write to stdout
                pass
            line = f"fairseq_fsdp2: error: {_sigterm_message(rank, save_dir, updates())}\n"
            os.write(2, line.encode())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)

    return handler


def _sigterm_message(rank: int, save_dir: Optional[str], updates: Optional[int]) -> str:
    where = f"on rank {rank}" + (f" at update {updates + 1}" if updates is not None else "")
    if under_torchrun_agent():
        who = (f"stopped by torchrun (SIGTERM) {where}: a worker failed or the job was "
               f"stopped; torchrun's error report names the failed rank")
    elif "SLURM_JOB_ID" in os.environ:
        who = (f"stopped by SLURM (SIGTERM) {where}: the job was cancelled or timed out, or a "
               f"task failed")
    else:
        who = f"stopped by the launcher (SIGTERM) {where}"
    attempt, max_restarts = restart_count()
    if save_dir is None:
        return f"{who} (--no-save: nothing to resume from)"
    if under_torchrun_agent() and attempt < max_restarts:
        return (f"{who}; torchrun restarts the workers (restart {attempt + 1} of "
                f"{max_restarts}), which resume from the newest complete checkpoint in "
                f"{save_dir}")
    return f"{who}; run the same command again to resume from the last checkpoint in {save_dir}"
