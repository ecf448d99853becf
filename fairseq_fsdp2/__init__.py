"""fairseq_fsdp2: a PyTorch FSDP2 (``fully_shard``) training backend for fairseq.

Load it into stock fairseq with ``fairseq-train --user-dir path/to/fairseq_fsdp2
--ddp-backend fsdp2 ...``; importing the package installs the registration
(integration/registration.py) and registers the NLLB architectures and the chunked-loss criteria.
"""
from .integration.registration import install

install()

from . import models  # noqa: E402,F401  (registers the NLLB architectures)
from .criterions import chunked  # noqa: E402,F401  (registers the chunked-loss criteria)
