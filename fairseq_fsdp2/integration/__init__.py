"""Where the plugin meets fairseq: the numbered patches installed at import (registration.py) and
the hydra entry's config handling (hydra_config.py)."""
