"""SLURM (``srun``): the settings fairseq derives from SLURM's environment.

fairseq's ``distributed_utils.infer_init_method`` does it with GPUs only (world size 0, and
``torch.cuda.set_device`` for a second task on a node, on CPU), so the plugin computes them: the
job's first node hosts the rendezvous at ``tcp://FIRST_NODE:--distributed-port``; one task per rank
(``--ntasks-per-node R``: rank ``SLURM_PROCID``, device ``SLURM_LOCALID``) or one task per node,
which starts that node's ranks itself (one per GPU; on CPU ``--distributed-world-size / nodes``;
``spawn.py``).
"""
from __future__ import annotations

import logging
import os
import subprocess

import torch

from ..errors import OptionError

logger = logging.getLogger(__name__)

SLURM_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")  # fairseq's order


def under_slurm() -> bool:
    return any(k in os.environ for k in SLURM_NODELIST)


def slurm_settings(dt, on_cuda: bool) -> None:
    """Fill in ``dt`` (fairseq's distributed_training config) from SLURM's environment:
    init method, world size, rank, device; ``distributed_no_spawn`` False means this task
    starts ``distributed_num_procs`` ranks itself (``spawn``)."""
    env = os.environ
    nodes = int(env.get("SLURM_NNODES", 1))
    tasks = int(env.get("SLURM_NTASKS", nodes))
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    tasks_per_node = int(per_node) if per_node and per_node.isdigit() else tasks // nodes
    if tasks_per_node > 1:  # one task per rank
        world, rank, spawned = tasks, int(env.get("SLURM_PROCID", 0)), 1
        device = int(env.get("SLURM_LOCALID", 0)) if on_cuda else 0
    else:  # one task per node: it starts the node's ranks
        if on_cuda:
            spawned = torch.cuda.device_count()
        else:
            asked = dt.distributed_world_size
            if asked > 1 and asked % nodes:
                raise OptionError(
                    f"--distributed-world-size {asked} is not a multiple of the {nodes} SLURM "
                    f"nodes (one task per node starts --distributed-world-size / nodes ranks "
                    f"on CPU)")
            spawned = max(1, asked // nodes)
        world, rank, device = nodes * spawned, int(env.get("SLURM_NODEID", 0)) * spawned, 0
    dt.distributed_world_size = world
    dt.distributed_rank = rank
    dt.device_id = device
    dt.distributed_no_spawn = spawned == 1
    dt.distributed_num_procs = spawned
    if world == 1:
        return  # one process: setup.py gives it a 1-rank group
    if dt.distributed_port <= 0:
        raise OptionError(
            "under SLURM, --distributed-port PORT is needed: a free port on the job's first "
            "node, the same for every task (it hosts the rendezvous)")
    nodelist = next(env[k] for k in SLURM_NODELIST if k in env)
    try:
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", nodelist], text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise OptionError(f"cannot find the first node of SLURM's {nodelist!r} with `scontrol "
                          f"show hostnames`: {e}") from e
    dt.distributed_init_method = f"tcp://{hosts.split()[0]}:{dt.distributed_port}"
    logger.info(f"SLURM: rank {rank}{f' to {rank + spawned - 1}' if spawned > 1 else ''} of "
                f"{world}, rendezvous at {dt.distributed_init_method}")
