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
    sent = [None, None]  # rank 0: the token, and why it could not write it
    if rank == 0:
        sent[0] = secrets.token_hex(8)
        try:
            os.makedirs(save_dir, exist_ok=True)
            with open(os.path.join(save_dir, MARKER + sent[0]), "w") as f:
                f.write(sent[0])
        except OSError as e:
            sent[1] = str(e)
    dist.broadcast_object_list(sent, src=0)
    token, write_error = sent
    if write_error:
        raise OptionError(f"--save-dir cannot be written on rank 0: {write_error}")
    path = os.path.join(save_dir, MARKER + token)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (_sees(path, token), socket.gethostname(),
                                   os.path.abspath(save_dir)))
    if rank == 0:
        os.remove(path)  # every rank has looked: the gather above waited for all
    blind = [r for r, (seen, _, _) in enumerate(views) if not seen]
    if blind:
        _, host0, dir0 = views[0]
        who = ", ".join(f"rank {r} (host {views[r][1]}, {views[r][2]})" for r in blind[:3])
        if len(blind) > 3:
            who += f" and {len(blind) - 3} more"
        raise OptionError(
            f"--save-dir is not the same directory on every rank: {who} cannot see the file "
            f"rank 0 (host {host0}) wrote in {dir0}; on several nodes --save-dir must be a "
            f"directory all nodes share (every rank writes shards there and reads the "
            f"checkpoint)")


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
