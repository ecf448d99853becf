"""``fairseq-hydra-train`` with the FSDP2 plugin loaded first.

fairseq's ``fairseq-hydra-train`` composes and validates the whole config (hydra + OmegaConf)
*before* it imports ``common.user_dir``, so the ``fsdp2`` backend value and the plugin's keys
(``distributed_training.fsdp2_root_reshard`` ...) are rejected there. This entry point imports
``fairseq_fsdp2`` first (``integration/registration.py``: options and hydra nodes, NLLB
architectures, trainer selection, launch wrapper) and then runs fairseq's own
``fairseq_cli.hydra_train.cli_main``::

    python -m fairseq_fsdp2.hydra_train --config-dir configs --config-name nllb_600m_finetune \\
        task.data=DATA distributed_training.fsdp2_root_reshard=always
    torchrun --standalone --nproc_per_node 8 -m fairseq_fsdp2.hydra_train --config-dir configs ...

The trainer selection and launch handling apply as on ``fairseq-train``: fairseq's hydra main
calls ``distributed_utils.call_main(cfg, fairseq_cli.train.main)``, which the plugin wraps, and
``fairseq_cli.train.main`` looks up the ``Trainer`` name the plugin rebinds.

It also accepts legacy (argparse-only) tasks and architectures in a hydra config, such as
``translation_multi_simple_epoch`` (integration/hydra_config.py), and gives hydra each job's
best validation score (``--multirun`` sweepers such as Optuna or Ax read it; fairseq's own
``hydra_main`` drops what it computes, which is not the best: see ``hydra_main``).
"""
from __future__ import annotations

import math
import os
import sys

import fairseq
import hydra

from .errors import OptionError
from .integration.hydra_config import (HydraConfigError, add_defaults_or_stop,
                                       check_fixed_group_overrides)
from .integration.registration import install_hydra_add_defaults, install_hydra_main
from .command_line.exits import stop
from .process import quiet
from .process.run_context import forget_previous_runs


#: fairseq's own config directory, where fairseq's hydra main looks for config.yaml
FAIRSEQ_CONFIG = os.path.join(os.path.dirname(fairseq.__file__), "config")


def hydra_main(cfg) -> float:
    """One hydra job: fairseq's hydra main; the job's best validation score goes back to hydra.

    The best is fairseq's own, the score of ``checkpoint_best.pt``: the best
    ``checkpoint.best_checkpoint_metric`` (``--best-checkpoint-metric``, the largest with
    ``maximize_best_checkpoint_metric``) of the validations at a save point (those fairseq
    compares for ``checkpoint_best.pt``, with --no-save too; the end of --max-update is one), and
    of the run a job resumes. fairseq's ``_hydra_main`` returns
    its smoothed ``valid`` meter instead, which a run never resets: with several validations,
    their mean. Without validation: the worst score there is (inf, -inf when maximizing).

    A sweep runs its jobs one after the other in this process, and fairseq keeps the best (and
    the --patience count) in attributes of its functions, for the process: each job starts
    without the previous job's."""
    from fairseq_cli import hydra_train
    from fairseq import checkpoint_utils

    forget_previous_runs()  # (an FSDP2 run does it again as it starts: other backends too)
    hydra_train._hydra_main(cfg)  # fairseq's; its public hydra_main returns None
    maximize = cfg.checkpoint.maximize_best_checkpoint_metric
    best = getattr(checkpoint_utils.save_checkpoint, "best", None)
    return float(best) if best is not None else -math.inf if maximize else math.inf


def cli_main() -> None:
    quiet.no_debug_log()
    try:
        check_fixed_group_overrides(sys.argv[1:])
    except HydraConfigError as e:  # the command's own line: one line, exit status 2
        stop(OptionError(str(e)), owned=True)
    # fairseq's hydra main (Hydra 1.0 config layout: deprecation notices at its import and
    # when it runs) with hydra's notices about it silenced (process/quiet.py)
    with quiet.silenced(quiet.HYDRA_DEPRECATIONS):
        from fairseq_cli import hydra_train  # what it imports is needed only here

        install_hydra_add_defaults(add_defaults_or_stop)
        # fairseq's decorator, less its missing version_base (hydra's 1.1 defaults, as fairseq
        # gets) and returning the job's result
        install_hydra_main(hydra.main(config_path=FAIRSEQ_CONFIG, config_name="config",
                                      version_base="1.1")(hydra_main))
        hydra_train.cli_main()


if __name__ == "__main__":
    cli_main()
