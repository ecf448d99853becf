"""Launch real multi-process fairseq runs the way torchrun does (one process per rank, the
torchrun environment variables set), so that per-rank flags such as stock fairseq's
``--distributed-rank`` can differ between ranks. Rank processes are forked by a pre-imported
server (forkserver.py) so that the suite does not pay the torch/fairseq import in every run."""
from __future__ import annotations

import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


#: Ports handed to rendezvous stores (MASTER_PORT, --distributed-port, torchrun endpoints).
#: Each pytest-xdist worker takes its own block below the kernel's ephemeral range (32768 on):
#: a port the kernel picked with bind(0) and that was closed again could be picked again for a
#: test running at the same time in the other worker, before the first test's rank 0 binds it.
#: Blocks apart, and ports taken in turn within a block, no two runs get the same port. Each
#: session starts at a random place in its block: two suites run side by side on one machine
#: (two checkouts) would otherwise hand out the same ports in the same order.
PORT_BLOCK = 2000
PORT_BASE = 20000
_ports = itertools.count(random.randrange(PORT_BLOCK))


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    base = PORT_BASE + PORT_BLOCK * int(worker.removeprefix("gw") or 0)
    for _ in range(PORT_BLOCK):
        port = base + next(_ports) % PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or in TIME_WAIT): take the next
            return port
    raise RuntimeError(f"no free port in {base}..{base + PORT_BLOCK - 1}")


def base_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


class ForkServer:
    """Client of tests/forkserver.py: starts rank processes without re-importing torch and
    fairseq each time (see there). One per test session, started on first use."""

    def __init__(self):
        #: where the server also takes requests from processes other than this one
        #: (fork_client.py: torchrun's workers)
        self.socket_path = os.path.join(tempfile.mkdtemp(prefix="forkserver-"), "socket")
        # -X frozen_modules=off: Python 3.11 freezes runpy, and inspect cannot map its frames
        # ("<frozen runpy>", in every forked rank's stack) to a file, so each inspect.stack()
        # walks all of sys.modules (~6,000 after torch) twice per such frame. hydra's
        # initialize, in every fairseq command's config conversion, calls it: 57-77 ms in a
        # forked process, 23-32 ms with runpy read from its source (measured on an AMD EPYC).
        self._proc = subprocess.Popen(
            [sys.executable, "-X", "frozen_modules=off",
             str(Path(__file__).with_name("forkserver.py")), self.socket_path],
            env=base_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=str(Path(__file__).parent))
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._answers: dict[str, dict] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            answer = json.loads(line)
            with self._cond:
                self._answers.setdefault(answer["id"], {}).update(answer)
                self._cond.notify_all()

    def _wait_for(self, key: str, field: str, timeout: Optional[float]):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while field not in self._answers.get(key, {}):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(key, timeout)
                if self._proc.poll() is not None:
                    raise RuntimeError("the test fork server died")
                self._cond.wait(left if left is not None else 1.0)
            return self._answers[key][field]

    def start(self, module: str, args: Sequence[str], env: dict, out: str,
              stdin: Optional[str] = None) -> "Forked":
        key = str(next(self._ids))
        request = {"id": key, "module": module, "args": list(args), "env": env,
                   "cwd": os.getcwd(), "out": out, "stdin": stdin}
        with self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        # the first answer comes after the server has imported torch and fairseq: seconds when
        # idle, minutes on a loaded 2-core machine; a dead server is reported at once instead
        return Forked(self, key, self._wait_for(key, "pid", 900), out)

    def close(self) -> None:
        """End the server (the end of its input) and wait for it, so that its CPU time and its
        children's count in this process's (``resource.RUSAGE_CHILDREN``, which
        scripts/benchmark_suite.py reads): a server never waited for takes the CPU time of
        every rank it forked out of that count."""
        self._proc.stdin.close()
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class Forked:
    """A rank process started by the fork server, with the parts of Popen the tests use."""

    def __init__(self, server: ForkServer, key: str, pid: int, out: str):
        self.server, self.key, self.pid, self.out = server, key, pid, out
        self.returncode: Optional[int] = None

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self.server._wait_for(self.key, "returncode", timeout)
        return self.returncode

    def poll(self) -> Optional[int]:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> str:
        with open(self.out, errors="replace") as f:
            return f.read()


class Spawned(subprocess.Popen):
    """A rank started as a fresh interpreter (``python -m``), for runs whose imports must see
    their own environment (e.g. a package on PYTHONPATH that fairseq probes at import)."""

    def __init__(self, module: str, args: Sequence[str], env: dict, out: str):
        self.out = out
        with open(out, "w") as f:
            super().__init__([sys.executable, "-m", module, *args], env=env, stdout=f,
                             stderr=subprocess.STDOUT)

    def output(self) -> str:
        with open(self.out, errors="replace") as f:
            return f.read()


_server: Optional[ForkServer] = None

#: torchrun's entry point for a worker forked from the server: ``[*FORKED_WORKER, MODULE, ARGS]``
#: in place of ``[SCRIPT, ARGS]``, with ``forked_worker_env()`` in the agent's environment.
FORKED_WORKER = [str(Path(__file__).with_name("fork_client.py"))]


def forked_worker_env() -> dict:
    from fork_client import SOCKET_ENV
    return {SOCKET_ENV: fork_server().socket_path}


def start_torchrun(args: Sequence, out: str, env: Optional[dict] = None) -> "Forked":
    """torchrun's agent (``python -m torch.distributed.run ARGS``), forked from the server; all
    its output and its workers' goes to ``out``. Give it ``[*FORKED_WORKER, MODULE, ...]`` as
    the entry point to have its workers forked from the server too."""
    return fork_server().start("torch.distributed.run", [str(a) for a in args],
                               base_env({**forked_worker_env(), **(env or {})}), out)


def fork_server() -> ForkServer:
    global _server
    if _server is None:
        _server = ForkServer()
    return _server


def close_fork_server() -> None:
    """End this session's fork server, if it started (ForkServer.close)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def start_ranks(nproc: int, args: Callable[[int], Sequence[str]], *,
                module: str = "fairseq_cli.train",
                env: Optional[dict | Callable[[int], dict]] = None,
                fresh_interpreter: bool = False, torchrun_env: bool = True) -> list:
    """Start ``python -m module args(rank)`` on nproc ranks (torchrun's environment, unless
    torchrun_env is False: plain processes): forked from the pre-imported server, or as fresh
    interpreters. ``env``: extra variables, or a function of the rank giving them."""
    port = free_port()
    logs = tempfile.mkdtemp(prefix="ranks-")
    procs = []
    for rank in range(nproc):
        e = base_env(env(rank) if callable(env) else env)
        if torchrun_env:
            e.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                      "WORLD_SIZE": str(nproc), "RANK": str(rank), "LOCAL_RANK": str(rank),
                      "LOCAL_WORLD_SIZE": str(nproc)})
        argv, out = [str(a) for a in args(rank)], os.path.join(logs, f"rank{rank}.log")
        procs.append(Spawned(module, argv, e, out) if fresh_interpreter
                     else fork_server().start(module, argv, e, out))
    return procs


def finish_ranks(procs: list, timeout: float = 240) -> list[RankResult]:
    """Wait for every rank; kill all of them once ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    results = []
    for rank, p in enumerate(procs):
        note = ""
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.wait(30)
            note = f"\n[launcher] rank {rank} killed after {timeout}s"
        results.append(RankResult(rank, p.returncode, p.output() + note))
    shutil.rmtree(os.path.dirname(procs[0].out), ignore_errors=True)  # the logs are read
    return results


def run_ranks(nproc: int, args: Callable[[int], Sequence[str]], *, timeout: float = 240,
              module: str = "fairseq_cli.train",
              env: Optional[dict | Callable[[int], dict]] = None,
              fresh_interpreter: bool = False, torchrun_env: bool = True) -> list[RankResult]:
    """Run ``python -m module args(rank)`` on nproc ranks; kill all of them after timeout."""
    return finish_ranks(start_ranks(nproc, args, module=module, env=env,
                                    fresh_interpreter=fresh_interpreter,
                                    torchrun_env=torchrun_env), timeout)


def start_command(module: str, *args, input: Optional[str] = None,
                  env: Optional[dict] = None) -> Forked:
    """Start ``python -m module args`` as one plain process (no torchrun environment), forked
    from the pre-imported server: for fairseq's other commands (generate, interactive) and the
    plugin's (consolidate). A module the server did not import (the plugin: fairseq-generate
    without --user-dir never sees it) is imported by the child, as on the command line.
    ``input``: text on its stdin; ``env``: extra variables. Its stdout and stderr go, together,
    to its output."""
    logs = tempfile.mkdtemp(prefix="command-")
    stdin = None
    if input is not None:
        stdin = os.path.join(logs, "stdin")
        with open(stdin, "w") as f:
            f.write(input)
    return fork_server().start(module, [str(a) for a in args], base_env(env),
                               os.path.join(logs, "out.log"), stdin)


def run_command(module: str, *args, input: Optional[str] = None, env: Optional[dict] = None,
                timeout: float = 240) -> RankResult:
    """start_command, waited for (killed after ``timeout``)."""
    (result,) = finish_ranks([start_command(module, *args, input=input, env=env)], timeout)
    return result


def ok(results: list[RankResult]) -> str:
    """Assert every rank exited 0 (showing the failing rank's output); rank 0's output."""
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}:\n{r.output[-4000:]}"
    return results[0].output


def train_inner(output: str) -> list[dict]:
    """The json train_inner records fairseq printed (--log-format json)."""
    records = []
    for line in output.splitlines():
        if "| train_inner |" in line:
            records.append(json.loads(line.split("| train_inner | ", 1)[1]))
    return records


#: a line fairseq's logging writes: "2026-12-05 15:00:00 | WARNING | fairseq_fsdp2.x | message"
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| [A-Z]+ \| [\w.]+ \| (.*)$")


def said_twice(output: str, shortest: int = 20) -> list[tuple[str, str]]:
    """(log message, other line) pairs of one process's output where a line that is not a log
    record (a print, a line of a multi-line record) says a log record's message again, or
    the record says the line's: a message printed beside its logger call. Lines and messages
    shorter than ``shortest`` characters are left out (table borders, blank lines)."""
    messages, others = [], []
    for line in output.splitlines():
        record = LOG_RECORD.match(line)
        if record:
            messages.append(record.group(1).strip())
        elif len(line.strip()) >= shortest:
            others.append(line.strip())
    return [(m, o) for m in messages if len(m) >= shortest for o in others if m in o or o in m]


def train_summary(output: str) -> dict:
    for line in output.splitlines():
        if "| train | " in line:
            return json.loads(line.split("| train | ", 1)[1])
    raise AssertionError("no end-of-epoch train record in output:\n" + output[-3000:])
