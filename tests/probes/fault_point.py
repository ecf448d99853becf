"""fairseq-train (with the plugin) that fails at one chosen point: test code, not plugin code
(the plugin has no fault-injection switch).

``FAULT=phase:update:who`` where who is a rank, or ``all`` (every rank is SIGKILLed at once, as
when a machine dies). Phases:
- ``forward`` / ``backward``: inside the model's forward / backward of that update;
- ``step``: inside the optimizer step;
- ``shards``: inside a save, after this rank wrote its shards, before they are committed;
- ``copy``: inside a save, halfway through fairseq copying the checkpoint file to
  checkpoint_last.pt (rank 0 only writes files);
- ``hang``: the rank stops (SIGSTOP) in forward, as a wedged process or host does;
- ``oom``: raises torch.OutOfMemoryError in forward (what CUDA raises);
- ``nan``: the loss of that update is NaN on that rank (and with checkpoints written in the
  background, rank 0 takes 5 s more to write the files of a save in that update: fairseq's
  crash.pt must not be lost when the process ends);
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


def install() -> None:
    from fairseq.trainer import Trainer
    import fairseq.file_io
    import torch.distributed.checkpoint as dcp
    from fairseq import checkpoint_utils

    state = {"update": 0}
    real_train_step = Trainer.train_step

    def train_step(self, samples, raise_oom=False):
        state["update"] = self.get_num_updates() + 1
        armed = mine and state["update"] == update
        if armed:
            arm(self.model, self.optimizer)
        if phase == "disk-full" and mine and state["update"] >= update:
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))
        return real_train_step(self, samples, raise_oom)

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

    def persistent_save(*args, **kwargs):
        if phase == "nan" and state["update"] == update and \
                threading.current_thread() is not threading.main_thread():
            time.sleep(5)  # longer than fairseq takes to re-run the update and raise
        return real_persistent_save(*args, **kwargs)
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
