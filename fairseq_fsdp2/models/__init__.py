"""Model architectures the plugin registers with fairseq (NLLB-200 dense sizes, nllb.py).

fairseq imports every ``models/*.py`` of a ``--user-dir`` by itself; importing ``nllb`` here as
well registers the architectures when the package is imported some other way (``import
fairseq_fsdp2`` before fairseq's own user-dir import, tests, ``fairseq-hydra-train``).
"""
from . import nllb  # noqa: F401
