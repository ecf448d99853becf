"""fairseq-train (with the plugin) that SIGKILLs itself inside its Nth sharded save, after the
shards are written and before they are committed: a crash in the middle of a save.

Used by tests/test_checkpoints.py as ``run_ranks(..., module="kill_in_save")``; N comes from
KILL_AT_SAVE. The patch lives here, in test code: the plugin has no fault-injection switch.
"""
import os
import signal

import torch.distributed.checkpoint as dcp

real_save = dcp.save
calls = {"n": 0}


def save_then_die(*args, **kwargs):
    calls["n"] += 1
    result = real_save(*args, **kwargs)
    if calls["n"] == int(os.environ["KILL_AT_SAVE"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return result


dcp.save = save_then_die

if __name__ == "__main__":
    from fairseq_cli.train import cli_main
    cli_main()
