"""Every rank must see the same ``--save-dir``.

Each rank writes its own shards into ``<save-dir>/fsdp2_shards/``, rank 0 alone writes the
checkpoint files, renames shard directories and removes old ones, and every rank reads the
checkpoint to resume. On several nodes that needs one directory all of them see (a shared file
system); a directory local to each node would give every node a partial checkpoint, and a
resume in which ranks load different states. Checked once, before anything is read or written:
rank 0 writes a file with a random name and token there, every rank looks for it.
"""
from __future__ import annotations

import os
import secrets
import socket
import time

import torch.distributed as dist

from ..errors import OptionError

MARKER = ".fsdp2-shared-save-dir-"
#: a network file system may show another node's new file a moment late
WAIT_S = 2.0


def check_shared(save_dir: str) -> None:
    """Raise OptionError (every rank alike) unless every rank sees rank 0's marker file."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    path = os.path.join(save_dir, MARKER + token[0])
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(token[0])
    dist.barrier()
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (_sees(path, token[0]), socket.gethostname()))
    if rank == 0:
        os.remove(path)  # every rank has looked: the gather above waited for all
    blind = [(r, host) for r, (seen, host) in enumerate(views) if not seen]
    if blind:
        who = ", ".join(f"rank {r} (host {host})" for r, host in blind)
        raise OptionError(
            f"--save-dir {save_dir} is not the same directory on every rank: {who} cannot see "
            f"the file rank 0 (host {views[0][1]}) wrote there; on several nodes --save-dir "
            f"must be a directory all nodes share (every rank writes shards there and reads "
            f"the checkpoint)")


def _sees(path: str, token: str) -> bool:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            with open(path) as f:
                return f.read() == token
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)
