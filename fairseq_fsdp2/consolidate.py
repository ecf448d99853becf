"""``python -m fairseq_fsdp2.consolidate CHECKPOINT OUT.pt``: see checkpoint/consolidate.py."""
import sys

from .checkpoint.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
