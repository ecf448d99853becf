"""fairseq-train (with the plugin) that reports, on every rank and for every update, which layers
ran, which FSDP2 units were gathered and reduce-scattered, and which layers got no gradient:
test code (tests/test_fairseq_compat.py's layerdrop test).

One line per rank and update: ``LAYERS {"rank": r, "update": n, "ran": {layer: forwards},
"gathered": [...], "reduced": [...], "no_grad": [...]}``, layers named as ``encoder.layers.1``.
Each update runs under ``torch.profiler`` (public API; FSDP2 labels a unit's all-gather
``FSDP::all_gather (<unit>)`` and its reduce-scatter ``FSDP::post_backward_reduce (<unit>)``),
whose events are read by name only, from the profiler's raw results (``key_averages()`` builds
every event's statistics too: 0.6 CPU-s an update, where the names take 0.05); a layer's
forwards are counted (one per micro-batch that ran it). fairseq's train_step sets every
gradient to None first, so a layer whose parameters hold none after it got no gradient
in that update.
"""
import collections
import json
import os
import re

from torch.profiler import ProfilerActivity, profile

GATHER = re.compile(r"FSDP::all_gather \((.*)\)$")
REDUCE = re.compile(r"FSDP::post_backward_reduce \((.*)\)$")


def install() -> None:
    from fairseq.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    real_train_step = Trainer.train_step
    ran: collections.Counter = collections.Counter()

    def layers(model):
        return [(f"{side}.layers.{i}", layer) for side in ("encoder", "decoder")
                for i, layer in enumerate(getattr(model, side).layers._modules.values())]

    def train_step(self, samples, raise_oom=False):
        model = self.model
        if not getattr(model, "_probe_hooked", False):
            for name, layer in layers(model):
                layer.register_forward_pre_hook(lambda m, a, name=name: ran.update([name]))
            model._probe_hooked = True
        ran.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = real_train_step(self, samples, raise_oom)
        events = {e.name() for e in prof.profiler.kineto_results.events()}
        report = {
            "rank": rank, "update": self.get_num_updates(), "ran": dict(sorted(ran.items())),
            "gathered": sorted(m.group(1) for m in map(GATHER.match, events) if m),
            "reduced": sorted(m.group(1) for m in map(REDUCE.match, events) if m),
            "no_grad": sorted(name for name, layer in layers(model)
                              if all(p.grad is None for p in layer.parameters()))}
        print("LAYERS " + json.dumps(report), flush=True)
        return out

    # fairseq's Trainer.train_step: FSDP2Trainer calls it through super()
    Trainer.train_step = train_step


install()

if __name__ == "__main__":
    from fairseq_cli.train import cli_main
    cli_main()
