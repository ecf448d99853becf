"""Run under tests/launcher.run_ranks: shard a tiny fairseq transformer with each root-reshard
setting, run one forward, and report whether the root's and the shared embedding's parameters
are still gathered (plain tensors) or resharded (DTensors) before backward; then, inside
``apply.all_unsharded`` (validation that generates), a different number of forwards per rank,
and one more forward after it.

argv: DATA_DIR. Prints one JSON line on rank 0: {setting: {"root": ..., "shared": ...}}.
"""
import sys

import torch
import torch.distributed as dist
from fairseq import options, tasks
from torch.distributed.tensor import DTensor

from probe_report import report_and_exit

import fairseq_fsdp2  # noqa: F401  (registration)
from fairseq_fsdp2.sharding.units import all_unsharded, apply_plan
from fairseq_fsdp2.sharding.mesh import build_mesh
from fairseq_fsdp2.sharding.plan import build_plan


def tiny_model(task, args):
    torch.manual_seed(1)
    return task.build_model(args)


def main():
    data = sys.argv[1]
    dist.init_process_group("gloo")
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        data, "--task", "translation", "--arch", "transformer", "--share-all-embeddings",
        "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
        "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
        "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--encoder-normalize-before",
        "--decoder-normalize-before"])
    task = tasks.setup_task(args)
    world = dist.get_world_size()
    src = torch.randint(4, 40, (2, 7))
    report = {}
    for setting in ("default", "always"):
        model = tiny_model(task, args)
        plan = build_plan(model, world_size=world, min_params_to_wrap=1, root_reshard=setting)
        apply_plan(model, plan, build_mesh("cpu", world))
        out, _ = model(src, torch.full((2,), 7), src)
        state = lambda p: "resharded" if isinstance(p, DTensor) else "gathered"  # noqa: E731
        report[setting] = {"root": state(model.encoder.layer_norm.weight),
                           "shared": state(model.encoder.embed_tokens.weight),
                           "layer": state(model.encoder.layers[0].fc1.weight)}
        out.float().sum().backward()
        # as --eval-bleu's generation: each rank runs its own number of forwards (no hang)
        with torch.no_grad(), all_unsharded(model):
            for _ in range(1 + 2 * dist.get_rank()):
                model(src[:1], torch.full((1,), 7), src[:1])
            report[setting]["generating"] = {"root": state(model.encoder.layer_norm.weight),
                                             "layer": state(model.encoder.layers[0].fc1.weight)}
        out, _ = model(src, torch.full((2,), 7), src)  # the settings are back
        report[setting]["after"] = {"root": state(model.encoder.layer_norm.weight),
                                    "layer": state(model.encoder.layers[0].fc1.weight)}
        out.float().sum().backward()
    report_and_exit(report, print_here=dist.get_rank() == 0)


if __name__ == "__main__":
    main()
