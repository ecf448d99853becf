"""fairseq's own spawning of one worker per GPU (plain ``fairseq-train`` on a multi-GPU node),
emulated on CPU for tests/test_gpu_logic.py: the parent's decision to spawn needs GPUs (fairseq
spawns min(GPUs, world size) processes), so this parent calls the plugin's spawn directly with 2
processes and fairseq-train's real ``main``; everything from the spawned workers on is what a
GPU node runs (gloo here instead of NCCL). The parent's own checks are skipped (on CPU they
refuse a world size of 2 without torchrun). Arguments: fairseq-train's."""
import sys

if __name__ == "__main__":
    import fairseq_cli.train
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_fsdp2  # noqa: F401  (the plugin, as --user-dir loads it)
    from fairseq_fsdp2 import spawn

    args = options.parse_args_and_arch(options.get_training_parser(), sys.argv[1:])
    cfg = convert_namespace_to_omegaconf(args)
    assert spawn.fairseq_would_spawn(cfg)
    spawn.run(cfg, fairseq_cli.train.main, {}, nprocs=2)
