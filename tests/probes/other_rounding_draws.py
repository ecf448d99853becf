"""fairseq-train whose stochastic rounding of Adam's stored moments (--bf16-adam-stats,
--eight-bit-adam-stats) and of bf16 weights (--memory-efficient-bf16) draws other random
numbers: their generators are seeded from the run's --seed plus OFFSET. The model's
initialisation, the order of the batches and the dropout masks come from --seed, untouched, so
the run differs from the plain one by its rounding draws alone: tests/test_adam_stats_8bit.py
and tests/test_bf16_weights.py compare a run with that spread (the noise of the rounding)
instead of a wide constant."""
from fairseq_cli.train import cli_main

from fairseq_fsdp2.optimizer import build

OFFSET = 1_000_003


def with_other_draws(use_moments):
    """``use_moments`` (build.use_16_bit_moments) with its ``seed`` moved by OFFSET."""
    def use(*args, seed: int = 0, **kwargs):
        return use_moments(*args, seed=seed + OFFSET, **kwargs)
    return use


if __name__ == "__main__":
    build.use_16_bit_moments = with_other_draws(build.use_16_bit_moments)
    cli_main()
