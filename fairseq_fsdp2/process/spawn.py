"""Ranks a task starts itself: SLURM's one task per node, or fairseq-train with
``--distributed-world-size N`` on one GPU machine.

fairseq would spawn ranks that call ``main`` directly, without the plugin's launch path (one-line
errors, the run's teardown, meta-device build, ``--heartbeat-timeout`` rendezvous). ``spawn``
starts them instead, and each runs fairseq's ``call_main``, which integration/registration.py
made ``lifecycle.call_main``. The plugin owns the processes it starts (command_line/exits.py).
"""
from __future__ import annotations

import importlib
import signal
import sys
from typing import Callable

from ..errors import RanksFailed
from ..command_line.exits import mark_started_by_plugin


def spawn(cfg, main: Callable, kwargs: dict) -> None:
    """Start this node's ``distributed_num_procs`` ranks (``torch.multiprocessing.spawn``, as
    fairseq does), each through the plugin's launch path; raise RanksFailed with the status of
    the first failed rank (it printed its own line)."""
    import torch.multiprocessing as mp
    dt = cfg.distributed_training
    try:
        mp.spawn(_spawned_rank, args=(_importable(main), cfg, kwargs, dt.distributed_rank),
                 nprocs=dt.distributed_num_procs, join=True)
    except mp.ProcessExitedException as e:
        rank = dt.distributed_rank + e.error_index
        if e.exit_code < 0:
            failed = RanksFailed(f"rank {rank} was killed by "
                                 f"{signal.Signals(-e.exit_code).name}", 1)
            failed.reported = False  # no line of its own: this is it
            raise failed from e
        raise RanksFailed(f"rank {rank} exited with status {e.exit_code}", e.exit_code) from e


def _importable(main: Callable) -> Callable:
    """``python -m fairseq_cli.train`` runs that file as ``__main__``; a spawned rank would get
    ``main`` with a copy of its globals, which integration/registration.py cannot
    reach (its ``Trainer``). Send the module's own function instead."""
    module = sys.modules.get(main.__module__)
    spec = getattr(module, "__spec__", None)
    if main.__module__ == "__main__" and spec is not None:
        return getattr(importlib.import_module(spec.name), main.__name__)
    return main


def _spawned_rank(i: int, main: Callable, cfg, kwargs: dict, start_rank: int) -> None:
    # A fresh interpreter: importing this module imported the plugin, which installed itself
    # into fairseq, so fairseq's call_main is the plugin's (lifecycle.call_main).
    from fairseq.distributed import utils as distributed_utils
    mark_started_by_plugin()
    dt = cfg.distributed_training
    dt.distributed_rank = start_rank + i
    dt.device_id = i
    dt.distributed_no_spawn = True
    distributed_utils.call_main(cfg, main, **kwargs)
