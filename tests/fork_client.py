"""``python fork_client.py MODULE ARGS...``: run ``python -m MODULE ARGS`` as a child of the tests'
fork server (forkserver.py) instead of a fresh interpreter, for processes that another program
starts: torchrun's agent starts its workers with this script as the entry point.

This process stays what the agent sees: the child gets this process's environment (RANK,
TORCHELASTIC_RESTART_COUNT, ...), working directory, stdin, stdout and stderr (passed over the
server's socket); the signals the agent sends (SIGTERM when another worker failed) are passed on
to the child; and this process ends as the child ended: its exit status, or killed by the same
signal (the agent reports a SIGKILLed worker as exitcode -9 either way). What differs from a fresh
interpreter is only what every forked run of the suite shares: torch and fairseq already
imported. Deliberately light (no torch): it starts in milliseconds.
"""
import json
import os
import signal
import socket
import sys

#: The fork server's socket path, set by tests/launcher.py for the processes it starts.
SOCKET_ENV = "FAIRSEQ_FSDP2_TEST_FORK_SOCKET"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.environ[SOCKET_ENV])
    request = {"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    pid = json.loads(sock.recv(4096))["pid"]

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass  # it has just ended: its status is on the way
    for signum in FORWARDED:
        signal.signal(signum, forward)
    answer = sock.recv(4096)  # the child's end; a forwarded signal does not interrupt it
    if not answer:
        sys.exit("fork_client: the fork server went away")
    code = json.loads(answer)["returncode"]
    if code < 0:  # killed by a signal: end the same way
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
