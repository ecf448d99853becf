"""fairseq-train (with the plugin), watched at the end of the run: test code, not plugin code.

- Every rank registers an ``atexit`` handler that writes ``END_DIR/atexit-rank<R>``: it appears
  only if the run's exit handlers ran (a bare ``os._exit`` skips them).
- The ranks start the run together: each waits until every rank has imported fairseq and the
  plugin (the --heartbeat-timeout that bounds the rendezvous does not then include imports).
- Rank 0's consolidated export is slow on purpose: before reading the shards it waits until
  every other rank's process has ended and at least ``SLOW_EXPORT_S`` seconds have passed
  (at most ``GIVE_UP_S``), then writes ``END_DIR/export.json`` with what it saw. If the other
  ranks waited for the export (in a collective bounded by --heartbeat-timeout) they could not
  end, and the export would give up.
"""
import atexit
import json
import os
import time

END_DIR = os.environ["END_DIR"]
SLOW_EXPORT_S = float(os.environ["SLOW_EXPORT_S"])
GIVE_UP_S = 60.0
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])


def _mark() -> None:
    with open(os.path.join(END_DIR, f"atexit-rank{rank}"), "w") as f:
        f.write(str(time.time()))


atexit.register(_mark)
with open(os.path.join(END_DIR, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))


def _ended(pid: int) -> bool:
    """The process is gone or a zombie (exited, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _slow(real):
    def model(*args, **kwargs):
        started = time.monotonic()
        peers = [int(open(os.path.join(END_DIR, f"pid{r}")).read()) for r in range(1, world)]
        while time.monotonic() - started < GIVE_UP_S:
            gone = all(_ended(p) for p in peers)
            if gone and time.monotonic() - started >= SLOW_EXPORT_S:
                break
            time.sleep(0.1)
        with open(os.path.join(END_DIR, "export.json"), "w") as f:
            json.dump({"peers_ended": gone, "waited_s": time.monotonic() - started}, f)
        return real(*args, **kwargs)
    return model


# first: it sets up logging before anything imports fairseq (as `python -m fairseq_cli.train`)
from fairseq_cli.train import cli_main  # noqa: E402
from fairseq.logging import progress_bar  # noqa: E402

if progress_bar.SummaryWriter is None:
    # fairseq looks for tensorboard once, when it is imported: in a rank forked from the
    # tests' fork server (which imported fairseq without the test-only packages on its path)
    # that lookup found none. The same lookup, redone now that PYTHONPATH holds them; the
    # writers and their exit handler (progress_bar._close_writers) are then fairseq's own.
    from torch.utils.tensorboard import SummaryWriter

    progress_bar.SummaryWriter = SummaryWriter

if rank == 0:
    from fairseq_fsdp2.checkpoint import export

    export._fsdp2_model = _slow(export._fsdp2_model)



def _all_imported() -> None:
    """Wait (at most GIVE_UP_S) until every rank has imported fairseq and the plugin: the
    run's --heartbeat-timeout also bounds the rendezvous, and fresh interpreters on a loaded
    machine finish their imports seconds apart; after this they meet within a parse."""
    mine = os.path.join(END_DIR, f"imported{rank}")
    with open(mine, "w") as f:
        f.write(str(time.time()))
    started = time.monotonic()
    while time.monotonic() - started < GIVE_UP_S:
        if all(os.path.exists(os.path.join(END_DIR, f"imported{r}")) for r in range(world)):
            return
        time.sleep(0.05)


if __name__ == "__main__":
    import fairseq_fsdp2  # noqa: F401  (what --user-dir would import, before the rendezvous)
    _all_imported()
    cli_main()
