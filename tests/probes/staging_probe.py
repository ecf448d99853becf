"""One rank: an asynchronous save (fairseq_fsdp2/checkpoint/async_save.py) whose staging copy is
held back until the optimizer step after it has begun: test code.

A tiny FSDP2 model takes one Adam step, is saved with ``async_save.start``, and takes a second
step at once. The staging thread's copies (``Tensor.copy_`` in a thread named
``fsdp2-staging``) wait until that step has begun (a step pre-hook registered before the
plugin's, so it runs first) and then until either the plugin's pre-hook holds the main thread
or the step has ended (a post-hook): events, not a sleep, so a loaded machine cannot let a step
that is not held finish after the copy. Unless the plugin's pre-hook holds the step until the
copy is done, the step changes the parameters before they are copied. The saved shards
must hold the first step's values.
Prints ``PROBE {"saved_equals_before": bool, "changed_by_step": bool}``.
"""
import os
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fairseq_fsdp2.checkpoint import async_save, sharded
import main_thread
from probe_report import report_and_exit

step_begun, step_done = threading.Event(), threading.Event()
real_copy = torch.Tensor.copy_
def copy_(self, src, non_blocking=False):
    if threading.current_thread().name.startswith("fsdp2-staging"):
        # copy once the step cannot change the parameters under the copy any more: either the
        # plugin holds it (correct), or it has already run (the bug this probe catches: the
        # saved values are then the second step's)
        step_begun.wait()
        main_thread.wait_until(lambda: step_done.is_set()
                               or main_thread.waits_in("_wait_for_staging"))
    return real_copy(self, src, non_blocking)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda *_: step_begun.set() if saving else None)
    optimizer.register_step_post_hook(lambda *_: step_done.set() if saving else None)
    saving = False

    def step():
        model(torch.randn(8, 64)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    save_dir = tempfile.mkdtemp()
    torch.Tensor.copy_ = copy_
    saving = True
    saves = async_save.BackgroundSaves()
    rel = saves.start(model, optimizer, save_dir, 1, stepping=optimizer)
    step()  # its pre-hooks: the probe's (releases the copy), then the plugin's
    saves.wait_pending()
    torch.Tensor.copy_ = real_copy
    after = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    state = sharded.state_to_save(model, None)  # loaded into the model: compared after
    dcp.load(state, checkpoint_id=os.path.join(save_dir, rel))
    saved = {k: v.full_tensor() for k, v in state["model"].items()}
    report_and_exit({
        "saved_equals_before": all(torch.equal(saved[k], before[k]) for k in before),
        "changed_by_step": any(not torch.equal(after[k], before[k]) for k in before)})


if __name__ == "__main__":
    main()
