"""fairseq-train (with the plugin) that SIGKILLs itself inside its Nth sharded save, after the
shards are written and before they are committed: a crash in the middle of a save.

Used by tests/test_checkpoints.py as ``run_ranks(..., module="kill_in_save")``; N comes from
KILL_AT_SAVE. With --write-checkpoints-asynchronously the shards are written by DCP's
background thread (``state_dict_saver.save`` called from there): that thread kills the process
once the main thread has finished one more update after the save point, so the kill falls
during a background write while training goes on. The patch lives here, in test code: the
plugin has no fault-injection switch.
"""
import os
import signal
import threading
import time

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver

real_save = dcp.save
calls = {"n": 0}
done = {"updates": 0}  # updates the main thread has finished
MAX_WAIT = 120  # seconds for that update: the test's own timeout ends a run stuck longer


def save_then_die(*args, **kwargs):
    calls["n"] += 1
    result = real_save(*args, **kwargs)
    if calls["n"] == int(os.environ["KILL_AT_SAVE"]):
        if threading.current_thread() is not threading.main_thread():
            # the save point's update, from the directory's name (fsdp2_shards/u<update>-...)
            saved_at = int(os.path.basename(str(kwargs["checkpoint_id"]))[1:9])
            deadline = time.time() + MAX_WAIT
            while done["updates"] <= saved_at and time.time() < deadline:
                time.sleep(0.01)
            print(f"KILLED_IN_BACKGROUND_SAVE after update {done['updates']}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return result


def install() -> None:
    from fairseq.trainer import Trainer

    real_train_step = Trainer.train_step

    def train_step(self, samples, raise_oom=False):
        out = real_train_step(self, samples, raise_oom)
        done["updates"] = self.get_num_updates()
        return out

    # fairseq's Trainer.train_step: FSDP2Trainer calls it through super()
    Trainer.train_step = train_step
    dcp.save = save_then_die  # the synchronous save (checkpoint/sharded.py)
    state_dict_saver.save = save_then_die  # what DCP's async_save calls in its thread


install()

if __name__ == "__main__":
    from fairseq_cli.train import cli_main
    cli_main()
