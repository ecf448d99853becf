"""fairseq-train (with the plugin) that fails at one chosen point: test code, not plugin code
(the plugin has no fault-injection switch).

``FAULT=phase:update:who`` where who is a rank, or ``all`` (every rank is SIGKILLed at once, as
when a machine dies). Phases:
- ``forward`` / ``backward``: inside the model's forward / backward of that update;
- ``step``: inside the optimizer step;
- ``shards``: inside a save, after this rank wrote its shards, before they are committed;
- ``copy``: inside a save, halfway through fairseq copying the checkpoint file to
  checkpoint_last.pt (rank 0 only writes files);
- ``hang``: the rank stops (SIGSTOP) in forward, as a wedged process or host does. So that only
  the hang can exhaust ``--heartbeat-timeout`` (not a stall of a loaded machine in an earlier
  update), every rank runs with torch's 30-minute collective timeout until that update begins,
  then with the timeout the plugin set (``heartbeat.set_collective_timeout``'s arguments and
  ``init_process_group``'s ``timeout``, recorded when the plugin made them and applied then);
- ``oom``: raises torch.OutOfMemoryError in forward (what CUDA raises);
- ``nan``: the loss of that update is NaN on that rank (and with checkpoints written in the
  background, crash.pt, which fairseq saves before it re-runs the update and raises, is written
  only once the main thread waits for it or has raised past it: it must not be lost when the
  process ends);
- ``disk-full``: from that update on, files larger than 128 KiB cannot be written (EFBIG: what
  a full disk does to the next large write).
With ``all``, the ranks write their pids to ``FAULT_DIR`` and the first rank to reach the point
kills every rank. Under torchrun's agent the fault strikes in the first attempt only (a restarted
attempt runs clean). A kill prints ``FAULT_KILL <time>`` (seconds since the epoch) first.
"""
import os
import resource
import shutil
import signal
import sys
import threading
import time

import main_thread
import fairseq_cli.train  # first, as fairseq-train: it configures logging before other imports
import torch

LIMIT = 128 * 1024  # disk-full: larger files fail (a rank's shards are larger; logs are not)
phase, update, who = os.environ["FAULT"].split(":")
update = int(update)
rank = int(os.environ["RANK"])
fault_dir = os.environ.get("FAULT_DIR")
mine = (who == "all" or int(who) == rank) and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                             "0") == "0"
if who == "all":
    with open(os.path.join(fault_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))


def die() -> None:
    print(f"FAULT_KILL {time.time():.3f}", flush=True)
    if who == "all":
        for name in os.listdir(fault_dir):
            pid = int(open(os.path.join(fault_dir, name)).read())
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    os.kill(os.getpid(), signal.SIGKILL)


#: until the hang's update: torch's default collective timeout (phase ``hang``)
LONG_TIMEOUT_S = 30 * 60
update_failed = threading.Event()  # phase nan: the update's error has left train_step


def defer_collective_timeouts() -> list:
    """Phase ``hang``: record the collective timeouts the plugin sets and keep torch's long one
    until ``apply`` (returned) is called at the hang's update, on every rank."""
    import torch.distributed as dist
    from fairseq_fsdp2.process import heartbeat

    recorded = []
    real_set, real_init = heartbeat.set_collective_timeout, dist.init_process_group

    def set_collective_timeout(seconds, groups):
        groups = list(groups)
        recorded.append((seconds, groups))
        real_set(LONG_TIMEOUT_S, groups)

    def init_process_group(*args, **kwargs):
        result = real_init(*args, **kwargs)
        if kwargs.get("timeout") is not None:
            recorded.append((kwargs["timeout"].total_seconds(), [dist.group.WORLD]))
            real_set(LONG_TIMEOUT_S, [dist.group.WORLD])
        return result

    def apply():
        for seconds, groups in recorded:
            real_set(seconds, groups)
    heartbeat.set_collective_timeout = set_collective_timeout
    dist.init_process_group = init_process_group
    return apply


def install() -> None:
    from fairseq.trainer import Trainer
    import fairseq.file_io
    import torch.distributed.checkpoint as dcp
    from fairseq import checkpoint_utils

    state = {"update": 0}
    real_train_step = Trainer.train_step
    apply_timeouts = defer_collective_timeouts() if phase == "hang" else None

    def train_step(self, samples, raise_oom=False):
        state["update"] = self.get_num_updates() + 1
        armed = mine and state["update"] == update
        if apply_timeouts is not None and state["update"] == update:
            apply_timeouts()
        if armed:
            arm(self.model, self.optimizer)
        if phase == "disk-full" and mine and state["update"] >= update:
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))
        try:
            return real_train_step(self, samples, raise_oom)
        except BaseException:
            if state["update"] == update:
                update_failed.set()
            raise

    # fairseq's Trainer.train_step: FSDP2Trainer calls it through super()
    Trainer.train_step = train_step

    real_save = dcp.save

    def save(*args, **kwargs):
        result = real_save(*args, **kwargs)
        if phase == "shards" and mine and state["update"] == update:
            die()
        return result
    dcp.save = save

    real_persistent_save = checkpoint_utils.torch_persistent_save

    def persistent_save(obj, filename, *args, **kwargs):
        if phase == "nan" and os.path.basename(filename) == "crash.pt" and \
                threading.current_thread() is not threading.main_thread():
            # once the main thread waits for it (the plugin's wait_pending before fairseq
            # raises) or has gone past it (an error out of train_step: nothing waited, and an
            # exit then loses the file)
            main_thread.wait_until(lambda: update_failed.is_set()
                                   or main_thread.waits_in("wait_pending"))
        return real_persistent_save(obj, filename, *args, **kwargs)
    checkpoint_utils.torch_persistent_save = persistent_save

    real_copyfile = shutil.copyfile

    def copyfile(src, dst, *args, **kwargs):
        if phase == "copy" and mine and state["update"] == update:
            with open(src, "rb") as f, open(dst, "wb") as g:  # half of it, then die
                g.write(f.read()[: os.path.getsize(src) // 2])
            die()
        return real_copyfile(src, dst, *args, **kwargs)
    shutil.copyfile = copyfile
    assert fairseq.file_io.shutil is shutil


def arm(model, optimizer) -> None:
    """One-shot hooks for this update."""
    first_layer = model.encoder.layers[0]
    if phase in ("forward", "oom", "hang"):
        def pre_forward(module, args):
            handle.remove()
            if phase == "hang":
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGSTOP)
            if phase == "oom":
                raise torch.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 20.00 GiB (simulated by the test)")
            die()
        handle = model.decoder.layers[-1].register_forward_pre_hook(pre_forward)
    elif phase == "backward":
        def pre_backward(module, grad_output):
            handle.remove()
            die()
        handle = first_layer.register_full_backward_pre_hook(pre_backward)
    elif phase == "nan":
        def nan_output(module, args, output):
            handle.remove()
            return (output[0] * float("nan"), *output[1:])  # (x, attn, ...) of a layer
        handle = model.decoder.layers[-1].register_forward_hook(nan_output)
    elif phase == "step":
        inner = optimizer.optimizer
        real_step = inner.step

        def step(*args, **kwargs):
            inner.step = real_step
            die()
        inner.step = step


install()

if __name__ == "__main__":
    fairseq_cli.train.cli_main()
