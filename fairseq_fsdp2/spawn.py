"""When fairseq itself starts the ranks: plain ``fairseq-train`` on a node with several GPUs
(fairseq's default world size is the number of GPUs) or SLURM with one task per node. fairseq's
``call_main`` then spawns one process per GPU with ``torch.multiprocessing.spawn`` and runs its
``distributed_main`` in each, which skips the plugin's launch path (launch.py wraps ``call_main``
in the parent only): no one-line errors, no clean exit, no meta-device build, no
``--heartbeat-timeout`` rendezvous in the workers.

So for FSDP2 runs the plugin spawns the workers itself, the way fairseq does (same number of
processes, ranks ``start + i``, GPU ``i``), and each worker, now one rank with
``--distributed-no-spawn`` semantics, goes through ``call_main`` again: the plugin's launch path
(launch.py), then fairseq's own ``distributed_main`` as under torchrun.
"""
from __future__ import annotations

import logging
import os
import sys

import torch
import torch.multiprocessing
from fairseq.distributed import utils as fairseq_distributed_utils
from omegaconf import open_dict


def fairseq_would_spawn(cfg) -> bool:
    """Fill in fairseq's launch inference (what its ``call_main`` does first) and say whether
    fairseq would now spawn the ranks of this node itself."""
    dt = cfg.distributed_training
    if dt.distributed_init_method is None:
        fairseq_distributed_utils.infer_init_method(dt)
    return dt.distributed_init_method is not None and not dt.distributed_no_spawn


def processes_per_node(cfg) -> int:
    """fairseq's choice: one process per GPU of this node, at most the world size."""
    return min(torch.cuda.device_count(), cfg.distributed_training.distributed_world_size)


def run(cfg, main, kwargs: dict, nprocs: int) -> None:
    """Spawn ``nprocs`` ranks of this node; each runs ``main`` through the plugin's launch path.
    A worker that stopped (a one-line error, exit 1 or 2) makes this process exit with its
    status; the worker already said why."""
    start_rank = cfg.distributed_training.distributed_rank
    try:
        torch.multiprocessing.spawn(_worker, args=(cfg, main, kwargs, start_rank),
                                    nprocs=nprocs, join=True)
    except torch.multiprocessing.ProcessExitedException as e:
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)


def _worker(i: int, cfg, main, kwargs: dict, start_rank: int) -> None:
    """One spawned rank (importing this module installed the plugin in this process)."""
    # fairseq-train's log format: its own logging.basicConfig (at the import of fairseq_cli.train)
    # did nothing here, since an earlier fairseq import in this fresh process already logged
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stdout, force=True,
                        level=os.environ.get("LOGLEVEL", "INFO").upper())
    dt = cfg.distributed_training
    with open_dict(dt):
        dt.distributed_rank = start_rank + i
        dt.device_id = i
        dt.distributed_no_spawn = True  # this process is one rank
    # fairseq's call_main, wrapped by the plugin (registration.py, patch 3): launch.call_main
    fairseq_distributed_utils.call_main(cfg, main, **kwargs)
