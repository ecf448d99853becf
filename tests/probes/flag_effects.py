"""fairseq-train (with the plugin) that reports what --cpu-offload and --checkpoint-activations
did to the sharded model: test code (tests/test_backend.py).

On rank 0, around update ``FLAG_EFFECTS_UPDATE`` (default 2), prints one line
``flag effects: {json}``:
- ``offload``: for every FSDP2 unit holding parameters, its path and the name of the offload
  policy ``fully_shard`` got (``CPUOffloadPolicy`` or ``OffloadPolicy``, FSDP2's "none"), and
  whether every one of its parameters is marked to be offloaded. torch has no public getter for
  a unit's policy: read from FSDP2's state (``_get_fsdp_state()._fsdp_param_group``, private;
  if torch renames it this probe fails loudly rather than reporting nothing).
- ``fc1_forwards``: for every encoder and decoder layer, how many times its ``fc1`` ran during
  that update. fairseq's ``checkpoint_wrapper`` recomputes a wrapped layer's forward inside
  backward, and the recomputation calls the layer's submodules again: 2 per micro-batch with
  activation checkpointing, 1 without.
Counting forward calls changes no value: the run's losses stay those of an unprobed run.
"""
import json
import os

from at_update import on_rank0_at_update

update = int(os.environ.get("FLAG_EFFECTS_UPDATE", "2"))


def offload_report(model) -> list:
    from torch.distributed.fsdp import FSDPModule
    units = []
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group  # private (docstring)
        if group is None:
            continue
        units.append({"unit": path or "<root>",
                      "policy": type(group.offload_policy).__name__,
                      "params_offloaded": all(p.offload_to_cpu for p in group.fsdp_params)})
    return units


def report(trainer, samples, step):
    model = trainer.model
    counts, handles = {}, []
    for side in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(model, side).layers):
            name = f"{side}.layers.{i}"
            counts[name] = 0

            def count(*_, name=name):
                counts[name] += 1
            handles.append(layer.fc1.register_forward_hook(count))
    try:
        out = step()
    finally:
        for handle in handles:
            handle.remove()
    effects = {"offload": offload_report(model), "fc1_forwards": counts,
               "micro_batches": len(samples)}
    print(f"flag effects: {json.dumps(effects, sort_keys=True)}", flush=True)
    return out


on_rank0_at_update(update, report)

if __name__ == "__main__":
    from fairseq_cli.train import cli_main
    cli_main()
