"""How an FSDP2 run starts and ends: launch settings, option checks, clean exit.

Wraps fairseq's ``distributed_utils.call_main`` (installed by ``integration/registration.py``):
- ``--ddp-backend fully_sharded`` (legacy, fairscale) is served by FSDP2;
- under torchrun (``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` set) no other distributed flag is needed;
  under SLURM the settings come from SLURM's environment; a plain single process gets a 1-rank
  group; ranks a task starts itself run this path too (spawn.py);
- gloo on CPU, NCCL on CUDA;
- bad options stop here with one line and exit status 2, before any work;
- a successful distributed run exits 0: torch's gloo/device-mesh teardown aborts at interpreter
  exit in about half of CPU runs, so after a clean finish the process group is destroyed, the
  ``atexit`` handlers are run here, and the process ends with ``os._exit(0)``; rank 0 writes the
  consolidated export after the other ranks have gone.
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from fairseq.distributed import utils as fairseq_distributed_utils
from omegaconf import open_dict

from ..checkpoint import async_save
from ..checkpoint.export import consolidate_at_end
from ..errors import FSDP2Error, OptionError, RankLostError, TrainingStopped, first_line
from ..options import FSDP2_BACKEND, LEGACY_FSDP_BACKEND, validate
from ..sharding import meta_build
from . import heartbeat, preflight, sigterm, slurm, spawn, torchrun

logger = logging.getLogger(__name__)

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
DEBUG_ENV = "FAIRSEQ_FSDP2_DEBUG"  # set to 1 for tracebacks instead of one-line errors
def call_main(fairseq_call_main, cfg, main, **kwargs):
    """Stand-in for fairseq's call_main: prepares FSDP2 runs, leaves other backends alone."""
    save_dir_existed = os.path.exists(cfg.checkpoint.save_dir)
    is_fsdp2 = False
    try:
        is_fsdp2 = set_up_run(cfg)
        if is_fsdp2 and not cfg.distributed_training.distributed_no_spawn:
            spawn.spawn(cfg, main, kwargs)  # each rank it starts runs this function
            return
        fairseq_call_main(cfg, main, **kwargs)
        if is_fsdp2:
            _after_training(cfg)
    except FSDP2Error as e:
        if os.environ.get(DEBUG_ENV):
            raise
        if not isinstance(e, TrainingStopped):
            _remove_if_created_empty(cfg.checkpoint.save_dir, save_dir_existed)
        _stop(str(e), e.exit_status)
    except Exception as e:
        if os.environ.get(DEBUG_ENV) or not is_fsdp2:
            raise
        missing_data = preflight.data_error(e, getattr(cfg.task, "data", None))
        if missing_data:
            _remove_if_created_empty(cfg.checkpoint.save_dir, save_dir_existed)
            _stop(missing_data, 2)
        beat = heartbeat.current()
        if beat is None or not heartbeat.looks_like_peer_loss(e):
            raise
        # A peer died or stopped answering: say which.
        logger.error(f"collective failed: {first_line(e, 300)}")
        _stop(heartbeat.describe_loss(
            beat, None if cfg.checkpoint.no_save else cfg.checkpoint.save_dir), 1)
    if is_fsdp2 and dist.is_initialized():
        _exit_cleanly()


def parse_args_and_arch(fairseq_parse, parser, input_args=None, *args, **kwargs):
    """Stand-in for fairseq's options.parse_args_and_arch: the same, except that for FSDP2
    runs fairseq's misleading parse-time errors become one clear line."""
    try:
        return fairseq_parse(parser, input_args, *args, **kwargs)
    except ValueError as e:
        argv = sys.argv[1:] if input_args is None else list(input_args)
        if "Cannot combine --fp16 and --tpu" not in str(e) or not _asks_for_fsdp2(argv) \
                or os.environ.get(DEBUG_ENV):
            raise
        _stop("--fp16 and --bf16 are mutually exclusive: choose one" if any(
            a in argv for a in ("--bf16", "--memory-efficient-bf16"))
            else "--tpu cannot be combined with --ddp-backend fsdp2", 2)


def _asks_for_fsdp2(argv: list[str]) -> bool:
    pairs = zip(argv, argv[1:] + [""])
    return any(a == "--ddp-backend" and b in (FSDP2_BACKEND, LEGACY_FSDP_BACKEND) or
               a in (f"--ddp-backend={FSDP2_BACKEND}", f"--ddp-backend={LEGACY_FSDP_BACKEND}")
               for a, b in pairs)


def set_up_run(cfg) -> bool:
    """Fill in launch settings for the FSDP2 backend and check the options. True if FSDP2."""
    dt = cfg.distributed_training
    if dt.ddp_backend == LEGACY_FSDP_BACKEND:
        logger.info("--ddp-backend fully_sharded is served by PyTorch FSDP2 (fairseq_fsdp2); "
                    "fairscale is not used")
        dt.ddp_backend = FSDP2_BACKEND
    if dt.ddp_backend != FSDP2_BACKEND:
        preflight.check_fsdp2_only_options(cfg)
        preflight.check_other_backend_restore(cfg)
        return False
    if cfg.common.tpu:
        if not cfg.common.bf16:
            raise OptionError("--tpu cannot be combined with --ddp-backend fsdp2")
        # fairseq turns --bf16 into --tpu (bf16 was TPU-only there); FSDP2 serves bf16 itself.
        cfg.common.tpu = False
        dt.tpu = False
    with open_dict(dt):
        on_cuda = torch.cuda.is_available() and not cfg.common.cpu
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
    preflight.check_launch(cfg, launched_per_rank=dt.distributed_no_spawn
                           or slurm.under_slurm(), on_cuda=on_cuda)
    if dt.distributed_init_method is None and dt.distributed_world_size > 1:
        # several GPUs, one process: fairseq's own single-node settings; spawn() starts the ranks
        fairseq_distributed_utils.infer_init_method(dt)
    validate(dt, min_params_to_wrap=getattr(cfg.model, "min_params_to_wrap", 0),
             fp16=cfg.common.fp16, bf16=cfg.common.bf16,
             world_size=dt.distributed_world_size,
             optimizer=getattr(cfg.optimizer, "_name", None),  # a Namespace for some
             fp16_adam_stats=bool(getattr(cfg.optimizer, "fp16_adam_stats", False)))
    preflight.check_fairseq_flags(cfg)
    meta_build.enable(preflight.weights_will_be_loaded(cfg))
    if dt.distributed_no_spawn:  # a rank (not a task that starts ranks)
        if cfg.checkpoint.write_checkpoints_asynchronously:
            # the trainer writes the shards in the background (checkpoint/async_save.py);
            # fairseq's own asynchronous writer (iopath) is switched off: see there why
            async_save.enable()
            cfg.checkpoint.write_checkpoints_asynchronously = False
        _init_process_group(cfg)
        _on_sigterm(cfg)
    return True


def _on_sigterm(cfg) -> None:
    """One line when the launcher stops this rank (sigterm.py); under torchrun,
    say which attempt this is."""
    save_dir = None if cfg.checkpoint.no_save else cfg.checkpoint.save_dir
    attempt, max_restarts = torchrun.restart_count()
    if attempt and os.environ.get("LOCAL_RANK") == "0":
        then = (f"resuming from the newest complete checkpoint in {save_dir}" if save_dir
                else "starting again (--no-save)")
        logger.warning(f"torchrun restart {attempt} of {max_restarts} "
                       f"(TORCHELASTIC_RESTART_COUNT={attempt}): {then}")
    beat = heartbeat.current
    sigterm.stop_on_sigterm(
        cfg.distributed_training.distributed_rank, save_dir,
        lambda: None if beat() is None else beat().num_updates)


def _init_process_group(cfg) -> None:
    """Open the process group here (fairseq then finds it initialized and uses it):
    - under torchrun's agent, always, each restart's rendezvous apart from the others'
      (torchrun.init_under_torchrun: what makes ``--max-restarts`` work);
    - with fairseq's ``--heartbeat-timeout N``, with an N-second timeout (fairseq's own init uses
      torch's 30 minutes, and a rank whose peer died before the rendezvous would wait that
      long)."""
    dt = cfg.distributed_training
    if dist.is_initialized() or dt.distributed_init_method is None:
        return
    timeout = timedelta(seconds=dt.heartbeat_timeout) if dt.heartbeat_timeout > 0 else None
    agent = torchrun.under_torchrun_agent() and dt.distributed_init_method == "env://"
    if timeout is None and not agent:
        return
    if dt.distributed_backend == "nccl":
        torch.cuda.set_device(dt.device_id)
    try:
        if agent:
            torchrun.init_under_torchrun(dt.distributed_backend, timeout)
        else:
            dist.init_process_group(backend=dt.distributed_backend,
                                    init_method=dt.distributed_init_method,
                                    world_size=dt.distributed_world_size,
                                    rank=dt.distributed_rank, timeout=timeout)
    except dist.DistError as e:
        within = f" within --heartbeat-timeout {dt.heartbeat_timeout} s" if timeout else ""
        raise RankLostError(
            f"rank {dt.distributed_rank} could not meet the other ranks at "
            f"{dt.distributed_init_method}{within} (a rank died or never started): "
            f"{first_line(e)}") from e
    # fairseq's distributed_init then warns that the group exists: expected here
    warnings.filterwarnings("ignore", message="Distributed is already initialized")


def _after_training(cfg) -> None:
    """The end of a successful run. Every rank meets once more (training and its last save are
    done everywhere), leaves the process group and runs what would run at interpreter exit
    (fairseq's TensorBoard writers, wandb's finish); then rank 0 alone exports checkpoint_best/
    last in stock fairseq format, with no collective left to time out: the other ranks have
    already gone, so a slow export of a large model cannot fail a finished run."""
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    async_save.wait_pending()  # the last save, written in the background (raises if it failed)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
        _run_exit_handlers()
    if rank == 0 and not cfg.checkpoint.no_save \
            and not cfg.distributed_training.fsdp2_no_consolidate \
            and os.path.isdir(cfg.checkpoint.save_dir):
        try:
            for path in consolidate_at_end(cfg.checkpoint.save_dir,
                                           cfg.checkpoint.checkpoint_suffix):
                logger.info(f"wrote consolidated checkpoint {path} (stock fairseq format)")
        except Exception as e:  # noqa: BLE001 - training is done; say how to export by hand
            if os.environ.get(DEBUG_ENV) or not distributed:
                raise
            print(f"fairseq_fsdp2: error: training finished, but the consolidated export "
                  f"failed: {first_line(e, 300)}; the sharded checkpoints in "
                  f"{cfg.checkpoint.save_dir} are intact: export by hand with python -m "
                  f"fairseq_fsdp2.consolidate CHECKPOINT OUT.pt", file=sys.stderr, flush=True)
            _exit_cleanly(1)
    if distributed:
        _exit_cleanly()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(message: str, status: int) -> None:
    """Report one line and exit. Once a process group exists, leave at once: tearing it down
    while other members are dead or inside a collective can hang (or abort, with gloo)."""
    print(f"fairseq_fsdp2: error: {message}", file=sys.stderr, flush=True)
    if not dist.is_initialized():
        sys.exit(status)
    logging.shutdown()
    os._exit(status)


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


def _run_exit_handlers() -> None:
    """Run the ``atexit`` handlers now, as interpreter exit would: the process then ends with
    ``os._exit``, which skips them (see ``_exit_cleanly``). Private API, no public equivalent:
    CPython's ``atexit._run_exitfuncs`` calls them last-registered first, reports a failing one
    and goes on, and empties the registry (tests/test_end_of_run.py fails if that changes)."""
    atexit._run_exitfuncs()


def _exit_cleanly(status: int = 0) -> None:
    """Leave without the interpreter's own teardown: with gloo and a device mesh it aborts
    (SIGABRT) in about half of CPU runs even after the group is destroyed (platform notes)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
