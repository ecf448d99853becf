"""A fork server for the tests: imports torch and fairseq once, then forks one process per rank.

Every rank of every test run is still a real, separate process that runs ``python -m MODULE``'s
code (``runpy.run_module`` as ``__main__``, the plugin loaded by ``--user-dir`` in the child,
exactly as on the command line) and ends through the observable steps of the interpreter's exit
(threads joined, atexit handlers, streams flushed: end_as_the_interpreter_does) or its own
``os._exit``. What is shared is only the ~5 s of importing torch and
fairseq, which otherwise dominates each 2-rank run of the suite on 2 cores.

Protocol (one JSON object per line): stdin gets ``{"id", "module", "args", "env", "cwd",
"out"}`` and optionally ``"stdin"`` (a file the child reads as its stdin); stdout answers
``{"id", "pid"}`` when forked and ``{"id", "returncode"}`` (negative: the signal) when the process
ends. Given a path, the server also listens on a UNIX socket there (SOCK_SEQPACKET: one message
per request) for processes that are not the test's own, torchrun's workers (fork_client.py):
a request ``{"module", "args", "env", "cwd"}`` comes with the client's stdin, stdout and stderr
(SCM_RIGHTS), which become the child's; the answers ``{"pid"}`` and ``{"returncode"}`` go back
on the connection. Single-threaded on purpose: forking a multi-threaded process can leave locks
held in the child.
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import runpy  # noqa: E402
import select  # noqa: E402
import socket  # noqa: E402
import weakref  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

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
# Imported later by many children, 0.005-0.03 CPU-s each (measured in a forked child): by
# fairseq_cli.train (megatron_trainer), by the first batch of torch's DataLoader (its
# record_function looks for the CUPTI monitor), by every torch.save/load (serialization.config)
# and DCP save or load (its fsspec storage), and by every reader of a SentencePiece model
# (the plugin's data preparation and vocabulary checks; protobuf).
import fairseq.model_parallel.megatron_trainer  # noqa: E402,F401
import torch.profiler._cupti_monitor  # noqa: E402,F401
import torch.utils.serialization.config  # noqa: E402,F401
import torch.distributed.checkpoint._fsspec_filesystem  # noqa: E402,F401
import sentencepiece.sentencepiece_model_pb2  # noqa: E402,F401
import warnings  # noqa: E402

from fairseq import options  # noqa: E402
from fairseq.dataclass.utils import convert_namespace_to_omegaconf  # noqa: E402

# Every fairseq command converts its argparse namespace to a hydra config; the first
# conversion in a process also builds hydra's and ANTLR's caches (the override grammar's DFA,
# fairseq's parser defaults): measured 0.35 s of the ~1.0 s a forked 2-update run takes. One
# conversion of a stock command line here leaves those caches warm for every child. It does not
# load the plugin or change fairseq's registries; hydra's global state is cleared on exit of its
# context, and the warnings it raises are ignored without being recorded (children still see
# them).
# Not fairseq_cli.train: its import configures logging (basicConfig on the child's stdout), so
# it must happen in the child. An import above logged through the root logger, which installed
# a default handler; basicConfig does nothing while one exists.
logging.root.handlers.clear()
# fairseq's parser reads --user-dir from sys.argv: keep the server's own argv out of it.
_argv, sys.argv = sys.argv, sys.argv[:1]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)  # hydra's debug lines would go to the test's stderr
    convert_namespace_to_omegaconf(options.parse_args_and_arch(
        options.get_training_parser(),
        ["unused", "--task", "translation", "--arch", "transformer"]))
    logging.disable(logging.NOTSET)
sys.argv = _argv


def run_child(request: dict, fds: Optional[list[int]] = None) -> None:
    """In the forked child: become ``python -m module args``; never returns. Its stdin, stdout
    and stderr are ``fds`` (a socket client's own, passed over the socket), or the files the
    request names."""
    if fds:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
    else:
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
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0  # as `python -m` does when the module returns
    except SystemExit as stop:
        code = exit_status(stop)
    except BaseException:  # as the interpreter does with an exception that leaves the module
        sys.excepthook(*sys.exc_info())
        code = 1
    end_as_the_interpreter_does(code)


def exit_status(stop: SystemExit) -> int:
    """The status ``python`` exits with for ``stop``: its code, 0 for None, 1 for anything else
    (printed to stderr first, as the interpreter prints ``sys.exit("message")``)."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def end_as_the_interpreter_does(code: int) -> None:
    """The steps of the interpreter's exit that a program can observe, in its order (CPython's
    Py_FinalizeEx): wait for the non-daemon threads and run threading's exit hooks
    (concurrent.futures' pools), run the atexit handlers (logging's shutdown, weakref.finalize
    objects, the program's own), flush stdout and stderr; then end the process with ``code``.
    What it leaves out is the teardown of every module and object the fork server imported
    (torch, fairseq) and the server's own weakref.finalize hooks (settle): 0.3 CPU-s of a forked
    rank's ~1.0, in each of the suite's ~500 forked processes, most of it copy-on-write page
    faults over the server's memory. A program whose correctness depended on that teardown
    (data left in a buffered file it never closed, a ``__del__`` with an effect outside the
    process) is already wrong: CPython does not promise to run either at exit. The tests that
    run real ``python -m`` processes (``fresh_interpreter=True``) keep the whole exit."""
    import atexit
    import threading
    threading._shutdown()  # private: the interpreter's own first exit step; no public twin
    atexit._run_exitfuncs()  # private name, public behaviour: the handlers ``atexit`` documents
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken, as the interpreter ignores it
            pass
    os._exit(code)


def fork(request: dict, fds: Optional[list[int]] = None, close: Sequence = ()) -> int:
    """Fork a child for ``request``; in the child, ``close`` (the server's sockets) first. The
    child's run ends the way ``python -m`` ends (SystemExit or an exception leaving serve)."""
    pid = os.fork()
    if pid == 0:
        for sock in close:
            sock.close()
        run_child(request, fds)
    return pid


def settle() -> None:
    """Once, before the first fork: leave the children only their own work at exit and in
    the collector."""
    # The server's own weakref.finalize hooks would run at every child's exit: torch's 174,
    # each undoing a torch.library registration made at import (0.045 CPU-s of each child's
    # exit, two thirds of a child that does nothing). Undoing registrations in a process that is
    # ending has no effect outside it: like the teardown of the modules the server imported,
    # end_as_the_interpreter_does leaves them out (and a hook with an effect outside the
    # process, made here, would have had it once per child). The hooks a child makes still run.
    for finalizer in list(weakref.finalize._registry):  # private: the only list of them
        finalizer.atexit = False
    # Everything imported so far is long-lived: move it out of the collector's sight, as gc's
    # documentation advises before forking. Each child's collections (during its run, and the
    # several full ones of interpreter exit, seconds each over torch and fairseq) then traverse
    # only what the child itself allocated; objects are still freed by reference counting.
    gc.freeze()


def serve(socket_path: Optional[str]) -> None:
    settle()
    stdin = sys.stdin.fileno()
    listener = None
    if socket_path:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(socket_path)
        listener.listen(64)
    pending = b""
    children: dict[int, str] = {}  # pid -> request id (stdin requests)
    clients: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    while True:
        ready, _, _ = select.select([stdin] + ([listener] if listener else []), [], [], 0.05)
        if stdin in ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                break  # the test session ended
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = fork(request, close=[listener, *clients.values()] if listener else ())
                children[pid] = request["id"]
                print(json.dumps({"id": request["id"], "pid": pid}), flush=True)
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            pid = fork(json.loads(message), fds, close=[listener, conn, *clients.values()])
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            clients[pid] = conn
        while children or clients:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            if pid in clients:
                conn = clients.pop(pid)
                try:
                    conn.send(json.dumps({"returncode": code}).encode())
                except OSError:
                    pass  # the client is gone (killed): nobody waits for this answer
                conn.close()
            else:
                print(json.dumps({"id": children.pop(pid), "returncode": code}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else None)
