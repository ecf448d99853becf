"""The FSDP2 trainer's checkpoints: what ``FSDP2Trainer`` (fsdp2_trainer.py) overrides of fairseq's
Trainer to save and load, as a mixin it inherits first.

fairseq's own save/load code runs unchanged; the model and optimizer entries of its checkpoint
file (written by rank 0) reference a DCP shard directory (sharded.py), written by every rank and
read back by the hooks below, at any world size. Also: stock checkpoints and Hugging Face
weights for fine-tuning (broadcast from rank 0), the newest complete checkpoint after a save cut
short, and one line for a failed save.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from datetime import timedelta

import torch
from fairseq import utils as fairseq_utils
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from ..checkpoint import async_save, sharded
from ..checkpoint.export import read_full_model
from ..errors import CheckpointError, no_space_left
from ..process import run_context
from ..checkpoint.full_state import broadcast_full_model
from ..checkpoint.grown_embedding import checkpoint_dictionary, grown as grow_embedding, \
    more_rows, smaller_dictionary
from ..checkpoint.safe_load import python_numbers, read_checkpoint_file
from ..checkpoint.shared_dir import check_shared
from ..hf import nllb_weights as hf_nllb
from ..memory.monitor import current_gb
from ..models import lora
from ..options import new_lang_sources
from ..optimizer.loss_scale import restore_scaler_counts, scaler_counts
from . import resume

logger = logging.getLogger(__name__)

#: the file fairseq's Trainer.train_step saves when an update fails, just before it raises
CRASH_FILE = "crash.pt"


class TrainerCheckpoints:
    """Mixin for ``FSDP2Trainer`` (before fairseq's Trainer in its bases): its attributes
    ``_shards``, ``_loading_from``, ``_weights_loaded`` and ``_memory`` are set there."""

    def consolidate_optimizer(self):
        """Write the shards. fairseq calls this on every rank at every save point (after its
        --no-save check, before deciding which files to write, and before a crash.pt), so
        the collective write happens on all ranks even when rank 0 then writes no file;
        ``state_dict()`` on the saving rank only references the result."""
        # Units that keep their parameters gathered after forward (root and shared embedding
        # with --fsdp2-root-reshard default) are still unsharded after validation's
        # forward-only pass; their entries would be plain tensors whose storage the next
        # reshard frees. Reshard everything first.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        self._gathered_optim_state = None  # fairseq's state_dict() reads it
        save_dir = self.cfg.checkpoint.save_dir
        # --write-checkpoints-asynchronously: the previous save, whole, before its directory
        # could look unreferenced below and before a second staging copy is made
        saves = _background_saves()
        if saves is not None:
            saves.wait_pending()
        if self.data_parallel_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            sharded.remove_unreferenced(save_dir)
        keep_optimizer = not self.cfg.checkpoint.no_save_optimizer_state
        optimizer = self.optimizer.optimizer if keep_optimizer else None
        with self._save_errors_reported():
            if lora.spec_of(self.model) is not None and self.lora_base is None:
                self._lora_base = sharded.save_base(self.model, save_dir)  # once per save dir
            extra = self.sharded_extras()
            if saves is not None:  # training goes on while the shards are written
                timeout = self.cfg.distributed_training.heartbeat_timeout
                self._shards = saves.start(
                    self.model, optimizer, save_dir, self.get_num_updates(),
                    self.optimizer.optimizer, timedelta(seconds=timeout) if timeout > 0 else None,
                    extra)
            else:
                self._shards = sharded.save(self.model, optimizer, save_dir,
                                            self.get_num_updates(), extra)

    def keep_pretrained_rows(self) -> None:
        """--lora-train-new-rows: zero the gradient of the shared embedding's pretrained rows
        (the first ``pretrained_rows``, recorded when the model was loaded or in the resumed
        checkpoint) before the norm and the step: with no gradient, ever, Adam's moments of
        those rows stay zero and so does their update (0 / (0 + eps)); SGD's too."""
        spec = lora.spec_of(self.model)
        rows = getattr(self, "_pretrained_rows", 0)
        if spec is None or spec.new_rows is None or not rows:
            return
        weight = dict(self.model.named_parameters())[spec.new_rows]
        if weight.grad is None:
            return
        if getattr(self, "_row_mask", None) is None:
            mask = (torch.arange(weight.shape[0]) >= rows).unsqueeze(1)
            if isinstance(weight.grad, DTensor):  # the rows of this rank's shard
                mask = distribute_tensor(mask, weight.grad.device_mesh, weight.grad.placements,
                                         src_data_rank=None).to_local()
            self._row_mask = mask.to(weight.grad.device)
        grad = weight.grad.to_local() if isinstance(weight.grad, DTensor) else weight.grad
        grad.mul_(self._row_mask)

    @property
    def lora_base(self):
        """A LoRA run's frozen base in this save dir (relative), once written (or resumed
        from this save dir); None before."""
        return getattr(self, "_lora_base", None)

    def sharded_extras(self) -> dict:
        """More state for the shards, beside model and optimizer (ema.py: the EMA's)."""
        return {}

    def save_checkpoint(self, filename, extra_state):
        resume.save_patience(self.cfg, extra_state)
        saves = _background_saves()
        if saves is not None:
            # fairseq's file, as its save_checkpoint builds it, written (with the copies fairseq
            # asks for) once its shards are complete: never a file naming incomplete shards
            state = fairseq_utils.move_to_cpu(self.state_dict())
            state["extra_state"].update(python_numbers(extra_state))
            if isinstance(state.get("cfg"), dict):  # the flag as asked (process/setup.py hid it)
                state["cfg"]["checkpoint"]["write_checkpoints_asynchronously"] = True
            saves.add_file(filename, state)
            if os.path.basename(filename) == CRASH_FILE:
                saves.wait_pending()  # fairseq raises right after: the process would end
            return os.path.abspath(filename)
        with self._save_errors_reported():
            super().save_checkpoint(filename, python_numbers(extra_state))

    @contextlib.contextmanager
    def _save_errors_reported(self):
        """A failed write (disk full, unwritable directory) stops training with one line;
        shards and files are written under temporary names, so earlier checkpoints are intact."""
        save_dir = self.cfg.checkpoint.save_dir
        try:
            yield
        except (OSError, CheckpointException, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not no_space_left(e, save_dir):
                raise  # not a write that failed (torch.save's short write: a RuntimeError)
            raise async_save.save_failed(self.get_num_updates(), save_dir, e) from e

    def state_dict(self):
        if self._shards is None:
            raise RuntimeError("state_dict() needs consolidate_optimizer() first, on every "
                               "rank: the shards are written collectively there")
        rel, self._shards = self._shards, None
        state = super().state_dict()  # model and optimizer entries are cheap shard references
        buffers = {k: v for k, v in state["model"].items() if not isinstance(v, DTensor)}
        state["model"] = {sharded.SHARDED: rel, **buffers}  # buffers: tiny, for fairseq's upgrade
        if "last_optimizer_state" in state:
            scale = state["last_optimizer_state"].get("loss_scale")
            counts = scaler_counts(self.optimizer)
            state["last_optimizer_state"] = {sharded.SHARDED: rel,
                                             **({"loss_scale": scale} if scale else {}),
                                             **({"loss_scaler": counts} if counts else {})}
        state["fsdp2"] = sharded.header(self.model, rel, self.data_parallel_world_size,
                                        self.lora_base)
        if "lora" in state["fsdp2"]:
            state["fsdp2"]["lora"]["pretrained_rows"] = getattr(self, "_pretrained_rows", 0)
        return python_numbers(state)  # fairseq keeps e.g. the best BLEU as a numpy scalar

    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False,
                        optimizer_overrides=None, reset_meters=False):
        info = None
        if not self.cfg.checkpoint.no_save:  # fairseq calls this once, at start, on every rank
            check_shared(self.cfg.checkpoint.save_dir)  # before anything is read or written
        if hf_nllb.is_hf_source(filename):  # --finetune-from-model of Hugging Face weights
            return self._load_pretrained(filename)
        restores_iterator = resume.restores_iterator(self.cfg.checkpoint, filename)
        filename = self._newest_complete(filename)
        if not os.path.isfile(filename) and \
                self.cfg.checkpoint.restore_file != sharded.DEFAULT_RESTORE_FILE:
            # fairseq would silently start from scratch; a named restore file must exist
            raise CheckpointError(f"--restore-file not found: {filename}")
        if os.path.isfile(filename):
            state = read_checkpoint_file(filename)  # memory-mapped: a cheap look
            info = state.get("fsdp2")
            if info is not None:
                shard_dir = sharded.resolve(filename, info["shards"])
                saved = sharded.saved_shapes(sharded.read_metadata(shard_dir, filename))
                if info.get("lora"):  # --lora-train-new-rows: where the added rows start
                    self._pretrained_rows = info["lora"].get("pretrained_rows", 0)
                if info.get("lora_base"):  # a LoRA checkpoint: its frozen base beside it
                    self._lora_base_dir = sharded.resolve(filename, info["lora_base"])
                    saved.update(sharded.saved_shapes(
                        sharded.read_metadata(self._lora_base_dir, filename)))
                    if os.path.dirname(os.path.abspath(filename)) == \
                            os.path.abspath(self.cfg.checkpoint.save_dir):
                        self._lora_base = info["lora_base"]  # this save dir's: not written again
            else:
                saved = {k: tuple(v.shape) for k, v in state["model"].items()
                         if torch.is_tensor(v)}
            if self._grows_embedding(filename, saved, reset_optimizer):  # bigger vocabulary
                kept = {k: state.get(k) for k in ("optimizer_history", "extra_state")}
                del state
                self._load_pretrained(filename)
                return self._reset_extra_state(kept)
            saved_lora = (info or {}).get("lora")
            # --finetune-from-model of a LoRA checkpoint into a LoRA run: its weights merged,
            # new adapters from their start (of any rank and modules), as from any other model
            lora_from_lora = lora.spec_of(self.model) is not None and saved_lora is not None \
                and self._finetunes_from(filename, reset_optimizer)
            if (lora.spec_of(self.model) is not None) != (saved_lora is not None) or \
                    lora_from_lora:
                if reset_optimizer and reset_lr_scheduler and reset_meters:
                    # fine-tuning across LoRA and full training: the weights (a LoRA
                    # checkpoint's merged), adapters from their start
                    kept = {k: state.get(k) for k in ("optimizer_history", "extra_state")}
                    del state
                    self._load_pretrained(filename)
                    return self._reset_extra_state(kept)
                if saved_lora is None:
                    raise CheckpointError(f"{filename} was not trained with --lora-rank: start "
                                          f"LoRA from it with --finetune-from-model")
                raise CheckpointError(f"{filename} was trained with --lora-rank "
                                      f"{saved_lora['rank']}: resume it with --lora-rank "
                                      f"{saved_lora['rank']}, or start from its merged weights "
                                      f"with --finetune-from-model")
            sharded.check_model_matches(self.model, saved, filename)
            kept = {k: state.get(k) for k in ("optimizer_history", "extra_state")}
            del state  # the weights: read again where needed (by rank 0 only, below)
            if info is None and reset_optimizer and reset_lr_scheduler and reset_meters \
                    and self.data_parallel_world_size > 1:
                self._load_pretrained(filename)
                return self._reset_extra_state(kept)
        self._loading_from = filename
        try:
            with sharded.trainer_loading():  # the shards: each rank reads its own
                extra_state = super().load_checkpoint(filename, reset_optimizer,
                                                      reset_lr_scheduler, optimizer_overrides,
                                                      reset_meters)
        finally:
            self._loading_from = None
        self._weights_loaded = self._weights_loaded or os.path.isfile(filename)
        if info is not None and extra_state is not None and restores_iterator:
            resume.rescale_iterator_position(extra_state, info["world_size"],
                                             self.data_parallel_world_size)
        if extra_state is not None and not (reset_optimizer or reset_meters):
            resume.restore_patience(extra_state)  # as fairseq restores the best score
        return extra_state

    def _reset_extra_state(self, state: dict):
        """What fairseq's Trainer does with a checkpoint's extra state when the optimizer, lr
        scheduler and meters are reset (weights loaded): the model learns the saved update
        count, the lr scheduler the epoch, and the state goes back to fairseq, which restores
        the data loader's position from it unless --reset-dataloader (the epoch after the
        checkpoint's; --finetune-from-model resets it)."""
        history = state.get("optimizer_history") or [{}]
        if "num_updates" in history[-1]:
            self.model.set_num_updates(history[-1]["num_updates"])
        extra_state = state.get("extra_state")
        if extra_state is None:
            return None
        if "previous_training_time" in extra_state:
            self._previous_training_time = extra_state["previous_training_time"]
            self._start_time = time.time()
        self.lr_step(extra_state["train_iterator"]["epoch"])
        return extra_state

    def _newest_complete(self, filename: str) -> str:
        """fairseq resumes from checkpoint_last.pt. A save cut short after writing
        checkpoint_<epoch>_<updates>.pt whole, but before copying it to checkpoint_last.pt,
        leaves a newer complete checkpoint: resume from that one (lose nothing saved)."""
        if self.cfg.checkpoint.restore_file != sharded.DEFAULT_RESTORE_FILE or \
                not os.path.basename(filename).startswith("checkpoint_last"):
            return filename
        last = sharded.saved_updates(filename) if os.path.isfile(filename) else -1
        newer = sharded.newest_complete(os.path.dirname(filename), newer_than=last,
                                        suffix=self.cfg.checkpoint.checkpoint_suffix)
        if newer is None:
            return filename
        updates, path = newer
        logger.info(f"{path} (update {updates}) is newer than {filename} (update {last}), "
                    f"whose save was cut short: resuming from it")
        return path

    def _load_pretrained(self, filename):
        """A stock (consolidated) checkpoint or Hugging Face NLLB weights for fine-tuning
        (--finetune-from-model): rank 0 reads it memory-mapped and broadcasts one tensor at a
        time; every rank keeps only its shards, so no rank but 0 ever holds the full model.
        Training starts fresh (the optimizer, lr scheduler, meters and data loader are reset,
        as fairseq does)."""
        # a LoRA run's frozen base is these weights: written anew to this save dir, even
        # where the source is a LoRA checkpoint of this save dir (whose base is unmerged)
        self._lora_base = self._lora_base_dir = None
        self._memory.reset()
        before = current_gb(self.device)
        full, problem = None, None
        if self.data_parallel_rank == 0:
            try:
                full = self._pretrained_weights(filename)
            except CheckpointError as e:  # told to every rank by the broadcast
                problem = str(e)
        broadcast_full_model(self.model, full, filename, problem, skip=lora.is_adapter)
        rows = [getattr(self, "_pretrained_rows", 0)]  # rank 0 read them: every rank's mask
        torch.distributed.broadcast_object_list(rows, src=0)
        self._pretrained_rows = rows[0]
        self._weights_loaded = True
        del full
        ranks = self._memory.gather({"before_gb": before,
                                     "startup_gb": self._memory.startup_peak_gb})
        logger.info(f"loaded pretrained weights from {filename}; memory per rank before -> peak "
                    f"during the load (GB): " + ", ".join(
                        f"{r['before_gb']:.3f} -> {r['peak_gb']:.3f}" for r in ranks) +
                    "; peak while building the model: " + ", ".join(
                        f"{r['startup_gb']:.3f}" for r in ranks))
        return None

    def _pretrained_weights(self, filename):
        """Rank 0: the full model's tensors by fairseq name, memory-mapped; the shared
        embedding grown when the dictionary has more entries (grown_embedding.py)."""
        # the adapters start from their own initial values (broadcast_full_model skips
        # them): no source holds them, a LoRA checkpoint's come merged
        shapes = {k: v for k, v in sharded.model_shapes(self.model).items()
                  if not lora.is_adapter(k)}
        symbols = self.task.source_dictionary.symbols
        known = None  # the checkpoint's own dictionary, looked for if the embedding grows
        if hf_nllb.is_hf_source(filename):  # its tokenizer's rows checked here
            full = hf_nllb.open_checked(filename, self.cfg.model, shapes, symbols)
        else:
            full = read_full_model(filename)
            known = lambda: checkpoint_dictionary(  # noqa: E731
                filename, read_checkpoint_file(filename).get("cfg"))
        embedding = hf_nllb.FAIRSEQ_EMBEDDING[0]  # its rows before growing
        self._pretrained_rows = full[embedding].shape[0] if embedding in full else 0
        full, grown = grow_embedding(
            full, shapes[hf_nllb.FAIRSEQ_EMBEDDING[0]][0], symbols, filename,
            new_lang_sources(getattr(self.cfg.distributed_training, "init_new_langs_from",
                                     None)), known,
            (getattr(self.cfg.task, "data", None) or "").split(os.pathsep)[0] or None)
        if grown:
            logger.info(grown)
        return full

    def _grows_embedding(self, filename, saved, reset_optimizer) -> bool:
        """--finetune-from-model of a fairseq checkpoint with fewer embedding rows than the
        dictionary has entries (more rows: refused, one line)."""
        if not (self._finetunes_from(filename, reset_optimizer) and
                getattr(self.cfg.model, "share_all_embeddings", False)):
            return False
        shapes = sharded.model_shapes(self.model)
        rows = more_rows(shapes, saved)
        if rows is not None and rows[0] > rows[1]:
            raise CheckpointError(smaller_dictionary(rows[1], rows[0], filename))
        return rows is not None

    def _finetunes_from(self, filename, reset_optimizer) -> bool:
        """``filename`` is the --finetune-from-model source, being loaded as such."""
        source = self.cfg.checkpoint.finetune_from_model
        return bool(reset_optimizer and source and
                    os.path.abspath(source) == os.path.abspath(filename))

    def resolve_shards_before_the_models_own_load(self, model) -> None:
        """A model class's own ``load_state_dict`` may read the keys before nn.Module's (and
        its pre-hook, ``_load_sharded_model``) sees them: fairseq's
        MultilingualTransformerModel asserts that every key starts with ``models.``, which the
        sharded checkpoint's marker does not. Load the shards first, then hand the class's
        method the model's own keys."""
        class_load = model.load_state_dict

        def load_state_dict(state_dict, *args, **kwargs):
            self._load_sharded_model(model, state_dict, "")
            return class_load(state_dict, *args, **kwargs)
        model.load_state_dict = load_state_dict

    def _load_sharded_model(self, module, state_dict, prefix, *_):
        if prefix or sharded.SHARDED not in state_dict:
            return
        sharded.load_model(module, sharded.resolve(self._loading_from,
                                                   state_dict[sharded.SHARDED]),
                           getattr(self, "_lora_base_dir", None))
        state_dict.clear()
        state_dict.update(module.state_dict())

    def _load_sharded_optimizer(self, optimizer, state_dict):
        if sharded.SHARDED not in state_dict:
            return None
        sharded.load_optimizer(self.model, optimizer, sharded.resolve(
            self._loading_from, state_dict[sharded.SHARDED]))
        # fairseq's fp16 wrapper restored the loss scale itself; its window counts are ours
        restore_scaler_counts(self.optimizer, state_dict.get("loss_scaler"))
        return optimizer.state_dict()



def _background_saves() -> "async_save.BackgroundSaves | None":
    """The run's background saves (--write-checkpoints-asynchronously), or None."""
    run = run_context.current()
    return None if run is None else run.saves
