"""A fork server for the tests: imports torch and fairseq once, then forks one process per rank.

Every rank of every test run is still a real, separate process that runs ``python -m MODULE``'s
code (``runpy.run_module`` as ``__main__``, the plugin loaded by ``--user-dir`` in the child,
exactly as on the command line) and ends through the interpreter's normal exit (atexit handlers,
finalizers) or its own ``os._exit``. What is shared is only the ~5 s of importing torch and
fairseq, which otherwise dominates each 2-rank run of the suite on 2 cores.

Protocol (one JSON object per line): stdin gets ``{"id", "module", "args", "env", "cwd",
"out"}`` and optionally ``"stdin"`` (a file the child reads as its stdin); stdout answers ``{"id", "pid"}`` when forked and ``{"id", "returncode"}`` (negative: the
signal) when the process ends. Single-threaded on purpose: forking a multi-threaded process can
leave locks held in the child.
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import runpy  # noqa: E402
import select  # noqa: E402

# The heavy imports every run repeats. Not the plugin: importing it installs its changes into
# fairseq, which must happen in each child, as `--user-dir` does on the command line.
import torch  # noqa: E402,F401
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
import fairseq  # noqa: E402,F401
import fairseq.checkpoint_utils  # noqa: E402,F401
import fairseq.trainer  # noqa: E402,F401
# Imported lazily by every run: TorchDynamo on FSDP2's first DTensor call (torch._disable_dynamo,
# ~1.4 s), DCP's state_dict helpers, fairseq's quantization and hydra's config sources.
import torch._dynamo  # noqa: E402,F401
import torch.distributed.checkpoint.state_dict  # noqa: E402,F401
import fairseq.data.data_utils_fast  # noqa: E402,F401
import fairseq.quantization_utils  # noqa: E402,F401
import hydra._internal.core_plugins.basic_launcher  # noqa: E402,F401
import hydra._internal.core_plugins.structured_config_source  # noqa: E402,F401
import hydra._internal.core_plugins.importlib_resources_config_source  # noqa: E402,F401
# Not fairseq_cli.train: its import configures logging (basicConfig on the child's stdout), so
# it must happen in the child. An import above logged through the root logger, which installed
# a default handler; basicConfig does nothing while one exists.
logging.root.handlers.clear()


def run_child(request: dict) -> None:
    """In the forked child: become ``python -m module args``; never returns."""
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    stdin = os.open(request.get("stdin") or os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for path in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if path:
            sys.path.insert(0, path)
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)  # as `python -m` does when the module returns; an exception exits 1


def serve() -> None:
    # Everything imported so far is long-lived: move it out of the collector's sight, as gc's
    # documentation advises before forking. Each child's collections (during its run, and the
    # several full ones of interpreter exit, seconds each over torch and fairseq) then traverse
    # only what the child itself allocated; objects are still freed by reference counting.
    gc.freeze()
    stdin = sys.stdin.fileno()
    pending = b""
    children: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        if ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                break  # the test session ended
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    run_child(request)
                children[pid] = request["id"]
                print(json.dumps({"id": request["id"], "pid": pid}), flush=True)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            print(json.dumps({"id": children.pop(pid),
                              "returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
