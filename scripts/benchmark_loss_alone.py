"""(not a test; `.venv/bin/python scripts/benchmark_loss_alone.py`, env TOKENS, DIM, ROUNDS)
In-process side-by-side timing of the vocabulary loss alone (projection + log-softmax +
label-smoothed loss, forward + backward): stock formulas vs the fused chunked pass.
Interleaved rounds, median per config; the ratio is what counts (machine shared).
The timing: benchmarks/loss_alone.py."""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import loss_alone  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """No arguments: the sizes come from the environment (TOKENS, DIM, ROUNDS)."""
    return argparse.ArgumentParser(description="The vocabulary loss alone, stock vs fused "
                                   "chunked (env TOKENS, default 672; DIM, 128; ROUNDS, 5)")


def main(argv=None) -> None:
    build_parser().parse_args(argv)
    loss_alone.main(tokens=int(os.environ.get("TOKENS", 672)),
                    dim=int(os.environ.get("DIM", 128)),
                    rounds=int(os.environ.get("ROUNDS", 5)))


if __name__ == "__main__":
    main()
