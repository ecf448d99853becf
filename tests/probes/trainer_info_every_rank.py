"""fairseq-train with fairseq's trainer logging at INFO on every rank, for tests that check what
each rank did (fairseq sets the root logger of every rank but rank 0 to WARNING, so its
``NOTE: gradient overflow detected ...`` lines appear from rank 0 only). The logger's own level
lets its records through; the root's handlers print them. Nothing else changes."""
import logging

from fairseq_cli.train import cli_main

if __name__ == "__main__":
    logging.getLogger("fairseq.trainer").setLevel(logging.INFO)
    cli_main()
