"""Where the plugin meets fairseq: the numbered patches installed at import (registration.py),
the hydra entry's config handling (hydra_config.py), and fairseq's hub with NLLB's task
(hub.py)."""
