"""How an FSDP2 run starts: launch settings, option checks, the process group, the run context.

- ``--ddp-backend fully_sharded`` (legacy, fairscale) is served by FSDP2;
- under torchrun (``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` set) no other distributed flag is needed;
  under SLURM the settings come from SLURM's environment; a plain single process gets a 1-rank
  group; ranks a task starts itself run this path too (spawn.py);
- gloo on CPU, NCCL on CUDA;
- bad options raise OptionError here, before any work (lifecycle.py reports them);
- the 8-bit moments' CPU kernel is built (or loaded) here, before any collective timeout;
- the run's state goes into a run context (run_context.py), which the end of the run closes.
"""
from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from fairseq.distributed import utils as fairseq_distributed_utils
from omegaconf import open_dict

from ..errors import OptionError, RankLostError, first_line
from ..optimizer.moments import kernels
from ..command_line import preflight
from . import run_context, sigterm, slurm, torchrun
from .run_context import RunContext

logger = logging.getLogger(__name__)

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def set_up_run(cfg) -> Optional[RunContext]:
    """Fill in launch settings for the FSDP2 backend, check the options and open the run's
    context (and, on a rank, its process group). None for other backends (checked, then left
    to fairseq)."""
    dt = cfg.distributed_training
    if not preflight.trains_with_fsdp2(cfg):
        preflight.check_fsdp2_only_options(cfg)
        preflight.check_other_backend_restore(cfg)
        return None
    on_cuda = torch.cuda.is_available() and not cfg.common.cpu
    _fill_launch_settings(cfg, on_cuda)
    preflight.check_launch(cfg, launched_per_rank=dt.distributed_no_spawn
                           or slurm.under_slurm(), on_cuda=on_cuda)
    if dt.distributed_init_method is None and dt.distributed_world_size > 1:
        # several GPUs, one process: fairseq's own single-node settings; spawn() starts the ranks
        fairseq_distributed_utils.infer_init_method(dt)
    preflight.check_options(cfg)
    if not on_cuda and getattr(dt, "eight_bit_adam_stats", False):
        # the 8-bit moments' CPU kernel built now (about 30 s the first time, then loaded from
        # PyTorch's cache), not in the first optimizer step, where collective timeouts apply
        kernels.blockwise_8bit()
    background_saves = bool(dt.distributed_no_spawn
                            and cfg.checkpoint.write_checkpoints_asynchronously)
    if background_saves:
        # the trainer writes the shards in the background (checkpoint/async_save.py); fairseq's
        # own asynchronous writer (iopath) is switched off: see there why
        cfg.checkpoint.write_checkpoints_asynchronously = False
    run = run_context.open_run(builds_on_meta=preflight.weights_will_be_loaded(cfg),
                               background_saves=background_saves)
    if dt.distributed_no_spawn:  # a rank (not a task that starts ranks)
        try:
            _init_process_group(cfg, run)
            _on_sigterm(cfg, run)
        except BaseException:
            run.close()
            raise
    return run


def _fill_launch_settings(cfg, on_cuda: bool) -> None:
    """torchrun's and SLURM's environment, or a 1-rank group for a plain single process."""
    dt = cfg.distributed_training
    with open_dict(dt):
        if dt.distributed_init_method is None:
            if all(k in os.environ for k in TORCHRUN_ENV):
                dt.distributed_init_method = "env://"
                dt.distributed_world_size = int(os.environ["WORLD_SIZE"])
                dt.distributed_rank = int(os.environ["RANK"])
                dt.device_id = int(os.environ.get("LOCAL_RANK", 0))
                dt.distributed_no_spawn = True
            elif slurm.under_slurm():
                slurm.slurm_settings(dt, on_cuda)
            if dt.distributed_init_method is None and dt.distributed_world_size <= 1:
                # one process: FSDP2 still needs a process group (a 1-rank mesh)
                dt.distributed_init_method = f"tcp://127.0.0.1:{_free_port()}"
                dt.distributed_world_size = 1
                dt.distributed_rank = 0
                dt.distributed_no_spawn = True
        if not on_cuda and dt.distributed_backend == "nccl":
            dt.distributed_backend = "gloo"


def _on_sigterm(cfg, run: RunContext) -> None:
    """One line when the launcher stops this rank (sigterm.py); under torchrun,
    say which attempt this is."""
    save_dir = None if cfg.checkpoint.no_save else cfg.checkpoint.save_dir
    attempt, max_restarts = torchrun.restart_count()
    if attempt and os.environ.get("LOCAL_RANK") == "0":
        then = (f"resuming from the newest complete checkpoint in {save_dir}" if save_dir
                else "starting again (--no-save)")
        logger.warning(f"torchrun restart {attempt} of {max_restarts} "
                       f"(TORCHELASTIC_RESTART_COUNT={attempt}): {then}")
    run.set_sigterm_handler(sigterm.sigterm_handler(
        cfg.distributed_training.distributed_rank, save_dir,
        lambda: None if run.heartbeat is None else run.heartbeat.num_updates))


def _init_process_group(cfg, run: RunContext) -> None:
    """Open the process group here, fairseq then finds it initialized and uses it (unless the
    caller opened one: then that one is used and left open):
    - each run's rendezvous keys apart from those of the process's earlier runs (a second run
      in the same program) and, under torchrun's agent, from earlier attempts'
      (torchrun.init_under_torchrun: what makes ``--max-restarts`` work);
    - with fairseq's ``--heartbeat-timeout N``, with an N-second timeout (fairseq's own init uses
      torch's 30 minutes, and a rank whose peer died before the rendezvous would wait that
      long)."""
    dt = cfg.distributed_training
    if dist.is_initialized() or dt.distributed_init_method is None:
        return
    timeout = timedelta(seconds=dt.heartbeat_timeout) if dt.heartbeat_timeout > 0 else None
    agent = torchrun.under_torchrun_agent() and dt.distributed_init_method == "env://"
    if dt.distributed_backend == "nccl":
        previous = torch.cuda.current_device()
        torch.cuda.set_device(dt.device_id)
        run.on_close(lambda: torch.cuda.set_device(previous))  # the caller's, at the end
    try:
        if agent:
            torchrun.init_under_torchrun(dt.distributed_backend, timeout, run.index)
        else:
            torchrun.init_with_run_prefix(dt.distributed_backend, dt.distributed_init_method,
                                          dt.distributed_rank, dt.distributed_world_size,
                                          timeout, run.index)
    except dist.DistError as e:
        within = f" within --heartbeat-timeout {dt.heartbeat_timeout} s" if timeout else ""
        raise RankLostError(
            f"rank {dt.distributed_rank} could not meet the other ranks at "
            f"{dt.distributed_init_method}{within} (a rank died or never started): "
            f"{first_line(e)}") from e
    # fairseq's distributed_init then warns that the group exists: expected here (silenced for
    # the run: quiet.RUN_WARNINGS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
