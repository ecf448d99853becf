"""An FSDP2 run from start to end: fairseq's ``distributed_utils.call_main``, wrapped
(integration/registration.py).

- The run is set up (setup.py: launch settings, option checks, its run context and process
  group), then fairseq's own call_main trains.
- A successful run returns to its caller, as stock fairseq's does: every rank meets once more,
  the run context closes (run_context.py: the last background save, the heartbeat thread, the
  SIGTERM handler, the process group), then rank 0 alone writes the consolidated export, with no
  collective left that a slow export could time out. A training command then ends as any
  Python program does; a program that trained in-process goes on (to validate, generate, or
  train again).
- A failure is reported as one line with its exit status where the plugin owns the process,
  and raised as an FSDP2Error elsewhere (command_line/exits.py); fairseq errors that mean bad
  input (missing data) or a lost rank become one; any other error is raised as stock fairseq
  raises it. Only a lost rank ends an owned process at once (``os._exit``): the other ranks may
  be stuck in a collective with it.

Other backends pass through untouched, after the checks of the plugin's options.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch.distributed as dist

from ..checkpoint.export import consolidate_at_end
from ..errors import DEBUG_ENV, ExportFailed, FSDP2Error, OptionError, RankLostError, \
    TrainingStopped, first_line
from ..command_line import exits, preflight
from . import heartbeat, setup, spawn
from .run_context import RunContext

logger = logging.getLogger(__name__)


def call_main(fairseq_call_main, cfg, main, **kwargs):
    """Stand-in for fairseq's call_main: runs FSDP2 runs as described above, leaves other
    backends to fairseq."""
    save_dir_existed = os.path.exists(cfg.checkpoint.save_dir)
    owned = exits.owns_process()
    run: Optional[RunContext] = None
    try:
        run = setup.set_up_run(cfg)
        if run is None:  # another backend
            return fairseq_call_main(cfg, main, **kwargs)
        if not cfg.distributed_training.distributed_no_spawn:
            try:  # a task that starts its ranks (spawn.py); each runs this function
                spawn.spawn(cfg, main, kwargs)
            finally:
                run.close()
            return None
        fairseq_call_main(cfg, main, **kwargs)
        _after_training(cfg, run)
    except BaseException as e:  # noqa: BLE001 - reported or raised again below
        error = _explained(e, cfg, run)
        if error is None:  # not the plugin's to explain: as stock fairseq raises it
            if run is not None:
                run.close()
            raise
        if not isinstance(error, TrainingStopped):
            _remove_if_created_empty(cfg.checkpoint.save_dir, save_dir_existed)
        lost = isinstance(error, RankLostError)
        if run is not None and not (owned and lost):
            run.close()
        if error is not e:
            error.__cause__ = e
        dt = cfg.distributed_training  # its device_id: the rank on this machine, once known
        exits.stop(error, owned, leave_now=lost,
                 local_rank=dt.device_id if dt.distributed_init_method is not None else None)
    return None


def _explained(error: BaseException, cfg, run: Optional[RunContext]) -> Optional[FSDP2Error]:
    """The FSDP2Error that reports ``error``, or None to raise it as it is."""
    if isinstance(error, FSDP2Error):
        return error
    if run is None or not isinstance(error, Exception) or os.environ.get(DEBUG_ENV):
        return None
    missing_data = preflight.data_error(error, getattr(cfg.task, "data", None))
    if missing_data:
        return OptionError(missing_data)
    beat = run.heartbeat
    if beat is None or not heartbeat.looks_like_peer_loss(error):
        return None
    # A peer died or stopped answering: say which.
    logger.error(f"collective failed: {first_line(error, 300)}")
    return RankLostError(heartbeat.describe_loss(
        beat, None if cfg.checkpoint.no_save else cfg.checkpoint.save_dir))


def _after_training(cfg, run: RunContext) -> None:
    """The end of a successful run. Every rank meets once more (training and its last save are
    done everywhere) and closes the run context; then rank 0 alone exports checkpoint_best/
    last in stock fairseq format, with no collective left to time out: the other ranks may
    already have gone, so a slow export of a large model cannot fail a finished run."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if run.saves is not None:
        run.saves.wait_pending()  # the last save, written in the background (raises if failed)
    if dist.is_initialized():
        dist.barrier()
    run.close()
    if rank != 0 or cfg.checkpoint.no_save or cfg.distributed_training.fsdp2_no_consolidate \
            or not os.path.isdir(cfg.checkpoint.save_dir):
        return
    try:
        for path in consolidate_at_end(cfg.checkpoint.save_dir,
                                       cfg.checkpoint.checkpoint_suffix):
            logger.info(f"wrote consolidated checkpoint {path} (stock fairseq format)")
    except Exception as e:  # noqa: BLE001 - training is done; say how to export by hand
        if os.environ.get(DEBUG_ENV):
            raise
        raise ExportFailed(
            f"training finished, but the consolidated export failed: {first_line(e, 300)}; "
            f"the sharded checkpoints in {cfg.checkpoint.save_dir} are intact: export by hand "
            f"with python -m fairseq_fsdp2.consolidate CHECKPOINT OUT.pt") from e


def _remove_if_created_empty(save_dir: str, existed: bool) -> None:
    """Bad input writes nothing: fairseq creates --save-dir early (to check it is writable);
    remove it again if this run created it and it is still empty."""
    if existed:
        return
    try:  # every rank tries; another may remove it between any two of these calls
        if not os.listdir(save_dir):
            os.rmdir(save_dir)
    except OSError:
        pass  # gone already, or not empty (rmdir refuses): nothing of this run's to remove
