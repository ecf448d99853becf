"""Launch real multi-process fairseq runs the way torchrun does (one process per rank, the
torchrun environment variables set), so that per-rank flags such as stock fairseq's
``--distributed-rank`` can differ between ranks."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def run_ranks(nproc: int, args: Callable[[int], Sequence[str]], *, timeout: float = 240,
              module: str = "fairseq_cli.train", env: Optional[dict] = None) -> list[RankResult]:
    """Run ``python -m module args(rank)`` on nproc ranks; kill all of them after timeout."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        e = base_env(env)
        e.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                  "WORLD_SIZE": str(nproc), "RANK": str(rank), "LOCAL_RANK": str(rank),
                  "LOCAL_WORLD_SIZE": str(nproc)})
        procs.append(subprocess.Popen([sys.executable, "-m", module, *map(str, args(rank))],
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    results = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n[launcher] rank {rank} killed after {timeout}s"
        results.append(RankResult(rank, p.returncode, out))
    return results


def train_inner(output: str) -> list[dict]:
    """The json train_inner records fairseq printed (--log-format json)."""
    records = []
    for line in output.splitlines():
        if "| train_inner |" in line:
            records.append(json.loads(line.split("| train_inner | ", 1)[1]))
    return records


def train_summary(output: str) -> dict:
    for line in output.splitlines():
        if "| train | " in line:
            return json.loads(line.split("| train | ", 1)[1])
    raise AssertionError("no end-of-epoch train record in output:\n" + output[-3000:])
