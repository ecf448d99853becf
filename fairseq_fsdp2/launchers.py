"""How the ranks of an FSDP2 run are started, and stopped, by the launchers users run.

- torchrun: with ``--max-restarts N`` its agent restarts every worker after a failure; the
  workers then resume from the newest complete checkpoint. That needs a process group whose
  rendezvous keys cannot be mistaken for the dead attempt's: ``init_under_torchrun``.
- SLURM (``srun``): the settings fairseq derives from SLURM's environment
  (``distributed_utils.infer_init_method``): the job's first node hosts the rendezvous at
  ``tcp://FIRST_NODE:--distributed-port``; one task per rank (``--ntasks-per-node R``: rank
  ``SLURM_PROCID``, device ``SLURM_LOCALID``) or one task per node, which starts that node's
  ranks itself (one per GPU; on CPU ``--distributed-world-size / nodes``). The plugin computes
  them (``slurm_settings``) because fairseq's inference needs GPUs (world size 0, and
  ``torch.cuda.set_device`` for a second task on a node, on CPU).
- Ranks a task starts itself (SLURM's one task per node, or fairseq-train with
  ``--distributed-world-size N`` on one GPU machine): fairseq would spawn ranks that call
  ``main`` directly, without the plugin's launch path (one-line errors, clean exit,
  meta-device build, ``--heartbeat-timeout`` rendezvous). ``spawn`` starts them instead, and
  each runs ``launch.call_main``.
- SIGTERM (torchrun's agent stops the other workers this way about 0.1 s after one fails;
  SLURM on ``scancel`` or at the time limit): one line that says what happens next instead of
  whatever the signal interrupts (``stop_on_sigterm``).
"""
from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .errors import OptionError

logger = logging.getLogger(__name__)

SLURM_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")  # fairseq's order
STORE_PREFIX = "fairseq_fsdp2/attempt"


# -- torchrun ----------------------------------------------------------------------------------
def under_torchrun_agent() -> bool:
    """Started by torchrun's elastic agent (not a hand-set torchrun environment)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def restart_count() -> tuple[int, int]:
    """(this attempt's restart number, torchrun's --max-restarts); (0, 0) outside torchrun."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)))


def init_under_torchrun(backend: str, timeout: Optional[timedelta]) -> None:
    """Open the process group from torchrun's environment, in a namespace of its own for each
    attempt. The agent's store (``TORCHELASTIC_USE_AGENT_STORE``) outlives the workers, and
    torch's own init (with or without ``init_method="env://"``) keeps the group's keys there
    under the same names in every attempt: a restarted worker that looks up a peer before
    the peer has rewritten its address reads the dead attempt's one (``Gloo connectFullMesh
    failed ... Connection refused``: in 3 of 4 restarts of a plain torch script, bare or
    ``env://``, and in 2 of 2 with rank 0 starting a second later; with a key prefix per
    attempt every restart worked: c10d 4 of 4, default static 2 of 2, --standalone 1 of 1)."""
    given = {} if timeout is None else {"timeout": timeout}  # else torch's default
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, **given)  # rank 0 hosts a new store in every attempt
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout or default_pg_timeout)
    attempt = restart_count()[0]
    dist.init_process_group(backend, store=dist.PrefixStore(f"{STORE_PREFIX}{attempt}", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **given)


# -- SLURM -------------------------------------------------------------------------------------
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
        return  # one process: launch.py gives it a 1-rank group
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


# -- ranks started by this process -------------------------------------------------------------
def spawn(cfg, main: Callable, kwargs: dict) -> None:
    """Start this node's ``distributed_num_procs`` ranks (``torch.multiprocessing.spawn``, as
    fairseq does), each through the plugin's launch path; exit as the first failed rank did
    (it printed its own line)."""
    import torch.multiprocessing as mp
    dt = cfg.distributed_training
    try:
        mp.spawn(_spawned_rank, args=(_importable(main), cfg, kwargs, dt.distributed_rank),
                 nprocs=dt.distributed_num_procs, join=True)
    except mp.ProcessExitedException as e:
        if e.exit_code < 0:
            name = signal.Signals(-e.exit_code).name
            print(f"fairseq_fsdp2: error: rank {dt.distributed_rank + e.error_index} was killed "
                  f"by {name}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code if e.exit_code > 0 else 1)


def _importable(main: Callable) -> Callable:
    """``python -m fairseq_cli.train`` runs that file as ``__main__``; a spawned rank would get
    ``main`` with a copy of its globals, which registration.py cannot reach (its ``Trainer``).
    Send the module's own function instead."""
    module = sys.modules.get(main.__module__)
    spec = getattr(module, "__spec__", None)
    if main.__module__ == "__main__" and spec is not None:
        return getattr(importlib.import_module(spec.name), main.__name__)
    return main


def _spawned_rank(i: int, main: Callable, cfg, kwargs: dict, start_rank: int) -> None:
    # A fresh interpreter: importing this module imported the plugin, which installed itself
    # into fairseq, so fairseq's call_main is the plugin's (launch.call_main).
    from fairseq.distributed import utils as distributed_utils
    dt = cfg.distributed_training
    dt.distributed_rank = start_rank + i
    dt.device_id = i
    dt.distributed_no_spawn = True
    distributed_utils.call_main(cfg, main, **kwargs)


# -- stopping ----------------------------------------------------------------------------------
def stop_on_sigterm(rank: int, save_dir: Optional[str], updates: Callable[[], Optional[int]]):
    """On SIGTERM print one line (who stopped the run, where, what happens next), then end by
    the signal as before, so that the launcher sees what it sent."""
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

    signal.signal(signal.SIGTERM, handler)


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
