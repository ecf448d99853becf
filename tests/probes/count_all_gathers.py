"""fairseq-train (with the plugin) that counts FSDP2's all-gathers of one update: test code.

``COUNT_UPDATE=N`` (default 2): on rank 0, update N runs with every FSDP2 unit's all-gather
counted, and rank 0 prints one line ``all-gathers of update N: {"<unit's modules>": count, ...}``
(units gathered at least once). Updates other than N, and the other ranks, are untouched: an
all-gather is a collective, so every rank runs the same ones (a rank that ran another would stop
the run).

How: on gloo (``--cpu``) the plugin gives every unit its own all-gather
(fairseq_fsdp2/sharding/gloo_collectives.py, through the public
``FSDPModule.set_custom_all_gather``), which FSDP2 calls once per all-gather of the unit's
parameters. For update N each unit gets a counting wrapper of the same collective (the same
values), installed the same way; a unit's modules are read from FSDP2's state
(``_get_fsdp_state()._fsdp_param_group``, private, as tests/probes/flag_effects.py reads it).
``torch.profiler`` counted the same calls (FSDP2's ``FSDP::all_gather (<unit>)`` labels) at about
1 CPU-s per run (Kineto's start and parsing every event of the update); this costs nothing
measurable. Other backends: the probe stops the run (FSDP2's own collectives are not counted).
"""
import json
import os
from collections import Counter

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from at_update import on_rank0_at_update

from fairseq_fsdp2.sharding import gloo_collectives

update = int(os.environ.get("COUNT_UPDATE", "2"))


class Counted(gloo_collectives.BroadcastAllGather):
    """The plugin's all-gather, counting its calls under one unit's label."""

    def __init__(self, counts: Counter, label: str):
        self.counts, self.label = counts, label

    def __call__(self, *args, **kwargs):
        self.counts[self.label] += 1
        return super().__call__(*args, **kwargs)


def units(model) -> dict:
    """Each FSDP2 unit with parameters: (one of its modules, the names of all of them)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # private (docstring)
            if group is not None:
                found.setdefault(id(group), (module, []))[1].append(name)
    return found


def count(trainer, samples, step):
    model = trainer.model
    assert dist.get_backend() == dist.Backend.GLOO, "count_all_gathers counts gloo's only"
    counts = Counter()
    found = units(model)
    assert found, "no FSDP2 unit with parameters"
    for module, names in found.values():
        module.set_custom_all_gather(Counted(counts, ", ".join(names)))
    try:
        out = step()
    finally:
        gloo_collectives.install(model)  # the plugin's own again (one for every unit)
    print(f"all-gathers of update {update}: {json.dumps(dict(counts), sort_keys=True)}",
          flush=True)
    return out


on_rank0_at_update(update, count)

if __name__ == "__main__":
    from fairseq_cli.train import cli_main
    cli_main()
