"""``fairseq-train`` with the FSDP2 plugin loaded first, leaving ``--user-dir`` to the user.

fairseq takes one ``--user-dir``. A user whose own directory registers their task, model or
criterion (and fairseq's examples, such as ``--user-dir examples/translation_moe/
translation_moe_src``) runs this instead of ``fairseq-train``, with the same arguments and their
own ``--user-dir``: it imports ``fairseq_fsdp2`` (which installs the plugin: the ``fsdp2``
backend, its options, the NLLB architectures) and then runs fairseq's own
``fairseq_cli.train.cli_main``, which imports the user's directory and trains::

    python -m fairseq_fsdp2.train DATA --user-dir MY_DIR --ddp-backend fsdp2 ...
    fairseq-fsdp2-train DATA --user-dir MY_DIR --ddp-backend fsdp2 ...
    torchrun --nproc_per_node N -m fairseq_fsdp2.train DATA --user-dir MY_DIR ...

As under ``fairseq-train``, the plugin owns the process (one-line errors and their exit status:
command_line/exits.py), since the run comes through fairseq's ``cli_main``. The hydra equivalent is
``python -m fairseq_fsdp2.hydra_train`` with ``common.user_dir=MY_DIR``.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

# Nothing to import for the plugin: Python imports this module's package, fairseq_fsdp2, first,
# and that installs the plugin (its __init__.py) before fairseq builds its parser below.


def cli_main(argv: Optional[Sequence[str]] = None) -> None:
    """fairseq-train's command line (``argv``, default ``sys.argv[1:]``) with the plugin loaded."""
    from fairseq_cli import train
    if argv is not None:
        sys.argv = [sys.argv[0], *map(str, argv)]
    train.cli_main()


if __name__ == "__main__":
    cli_main()
