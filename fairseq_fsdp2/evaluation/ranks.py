"""Under torchrun the ranks share the directions: rank r translates every WORLD_SIZE-th one
(its hypotheses files are its own), and the results are gathered on every rank (gloo, the
objects only) for rank 0 to report. One process without torchrun translates them all."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    def mine(self, items: Sequence[T]) -> list[T]:
        return list(items[self.rank::self.world])

    def gather(self, mine: list, order: Sequence) -> list:
        """Every rank's share, merged back into ``order`` (results carry ``direction``)."""
        if self.world == 1:
            return mine
        import torch.distributed as dist
        shares: list = [None] * self.world
        dist.all_gather_object(shares, mine)
        by_name = {r.direction: r for share in shares for r in share}
        return [by_name[name] for name in order]


def from_environment() -> Ranks:
    """torchrun's (or SLURM's) rank and world size; a process group is started when more than
    one rank runs (close it with ``close``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return Ranks(rank, world, local)


def close(ranks: Ranks) -> None:
    if ranks.world > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
