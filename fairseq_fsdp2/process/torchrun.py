"""torchrun: its environment, its restart count, and a process group that survives restarts.

With ``--max-restarts N`` torchrun's agent restarts every worker after a failure; the workers then
resume from the newest complete checkpoint. That needs a process group whose rendezvous keys
cannot be mistaken for the dead attempt's: ``init_under_torchrun``.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

STORE_PREFIX = "fairseq_fsdp2/attempt"
RUN_PREFIX = "fairseq_fsdp2/run"


def init_with_run_prefix(backend: str, init_method: str, rank: int, world_size: int,
                         timeout: Optional[timedelta], run: int) -> None:
    """Open the process group at ``init_method`` (torch's rendezvous), its keys apart from those
    of this process's earlier runs: rank 0's store of an earlier ``env://`` run can outlive that
    run (whatever still references it), and a peer that looked up the new run's addresses
    there read the old ones (``Gloo connectFullMesh failed ... Connection refused``, or a hang;
    measured with two runs in one program on 2 ranks, tests/test_in_process.py)."""
    store, rank, world_size = next(dist.rendezvous(
        init_method, rank=rank, world_size=world_size, timeout=timeout or default_pg_timeout))
    given = {} if timeout is None else {"timeout": timeout}  # else torch's default
    dist.init_process_group(backend, store=dist.PrefixStore(f"{RUN_PREFIX}{run}/", store),
                            rank=rank, world_size=world_size, **given)


def under_torchrun_agent() -> bool:
    """Started by torchrun's elastic agent (not a hand-set torchrun environment)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def restart_count() -> tuple[int, int]:
    """(this attempt's restart number, torchrun's --max-restarts); (0, 0) outside torchrun."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)))


def init_under_torchrun(backend: str, timeout: Optional[timedelta], run: int = 0) -> None:
    """Open the process group from torchrun's environment, in a namespace of its own for each
    attempt. The agent's store (``TORCHELASTIC_USE_AGENT_STORE``) outlives the workers, and
    torch's own init (with or without ``init_method="env://"``) keeps the group's keys there
    under the same names in every attempt: a restarted worker that looks up a peer before
    the peer has rewritten its address reads the dead attempt's one (``Gloo connectFullMesh
    failed ... Connection refused``: in 3 of 4 restarts of a plain torch script, bare or
    ``env://``, and in 2 of 2 with rank 0 starting a second later; with a key prefix per
    attempt every restart worked: c10d 4 of 4, default static 2 of 2, --standalone 1 of 1).
    ``run``: the how-manieth run of this process (run_context.py), apart likewise: a program
    that trains twice under torchrun opens a group per run in the same store."""
    given = {} if timeout is None else {"timeout": timeout}  # else torch's default
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # rank 0 hosts a new store in every attempt; runs apart as without torchrun
        init_with_run_prefix(backend, "env://", int(os.environ["RANK"]),
                             int(os.environ["WORLD_SIZE"]), timeout, run)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout or default_pg_timeout)
    attempt = restart_count()[0]
    dist.init_process_group(backend, store=dist.PrefixStore(
                                f"{STORE_PREFIX}{attempt}/{RUN_PREFIX}{run}", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **given)
