"""fairseq-train whose bf16 weights (--memory-efficient-bf16) are written back rounded to
nearest instead of stochastically (optimizer/row_chunk_step.RowChunkSteps.
round_weights_to_nearest): the control run of tests/test_bf16_weights.py, which shows what
stochastic rounding keeps at fine-tuning learning rates (stock fairseq's --memory-efficient-bf16
rounds so)."""
from fairseq_cli.train import cli_main

from fairseq_fsdp2.optimizer.row_chunk_step import RowChunkSteps

if __name__ == "__main__":
    RowChunkSteps.round_weights_to_nearest = True
    cli_main()
