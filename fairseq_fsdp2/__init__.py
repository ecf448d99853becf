"""fairseq_fsdp2: a PyTorch FSDP2 (``fully_shard``) training backend for fairseq.

Load it into stock fairseq with ``fairseq-train --user-dir path/to/fairseq_fsdp2
--ddp-backend fsdp2 ...``; importing the package installs the registration (registration.py).
"""
from .registration import install

install()
