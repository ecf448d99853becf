"""fairseq-train (with the plugin) that counts FSDP2's all-gathers of one update: test code.

``COUNT_UPDATE=N`` (default 2): on rank 0, update N runs under ``torch.profiler`` (public API;
FSDP2 labels each all-gather ``FSDP::all_gather (<unit's modules>)``) and rank 0 prints one line
``all-gathers of update N: {"<unit's modules>": count, ...}``. Updates other than N, and the other
ranks, are untouched: an all-gather is a collective, so every rank runs the same ones (a rank
that ran another would stop the run), and the profiler costs each rank it runs on about 1 CPU-s.
"""
import json
import os

from torch.profiler import ProfilerActivity, profile

from at_update import on_rank0_at_update

PREFIX = "FSDP::all_gather ("
update = int(os.environ.get("COUNT_UPDATE", "2"))


def count(trainer, samples, step):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = step()
    counts = {e.key[len(PREFIX):-1]: e.count for e in prof.key_averages()
              if e.key.startswith(PREFIX)}
    print(f"all-gathers of update {update}: {json.dumps(counts, sort_keys=True)}", flush=True)
    return out


on_rank0_at_update(update, count)

if __name__ == "__main__":
    from fairseq_cli.train import cli_main
    cli_main()
