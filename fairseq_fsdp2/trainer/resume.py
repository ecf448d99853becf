"""Exact resume at epoch boundaries: the train iterator a resumed run builds is the one the
uninterrupted run used.

fairseq's ``FairseqTask.get_batch_iterator`` groups sentences into batches once, under
``numpy_seed(seed + epoch)`` with the epoch at which the iterator is *created*, and caches the
iterator; later epochs only reshuffle the batch order. An uninterrupted run creates it at epoch
1, a run resumed in epoch E creates it at epoch E: equal-length sentences land in other batches
and every update after the resume differs (stock fairseq too). The saved iterator state
(epoch, position, shuffle) cannot carry this, so build a cached iterator as at epoch 1, then
give it its epoch. Iterators that are not cached (``--update-epoch-batch-itr``, datasets that
cannot reuse one, sharded data, tasks with their own per-epoch batching such as
translation_multi_simple_epoch's temperature sampling) are rebuilt every epoch by the
uninterrupted run as well: those are built at the real epoch, as before; a dataset with
virtual epochs first replays the earlier ones (``replay_virtual_epochs``).
"""
from __future__ import annotations

import contextlib
import logging
import sys

from ..errors import CheckpointError

logger = logging.getLogger(__name__)

FIRST_EPOCH = 1


@contextlib.contextmanager
def batches_as_first_built(task, cfg, epoch: int, disable_iterator_cache: bool,
                           resuming: bool):
    """While fairseq's ``Trainer.get_train_iterator(epoch)`` runs for the first time in a
    process (``resuming``): the dataset is loaded for ``epoch`` as usual, but a train iterator
    the task will cache is built as at epoch 1, and a dataset with virtual epochs is brought to
    the state the uninterrupted run's was in."""
    if not resuming or epoch == FIRST_EPOCH or disable_iterator_cache:
        yield
        return
    fairseq_get_batch_iterator = task.get_batch_iterator

    def get_batch_iterator(dataset, **kwargs):
        if not task.has_sharded_data(cfg.dataset.train_subset):
            replay_virtual_epochs(dataset, epoch)
        if dataset in task.dataset_to_epoch_iter or not task.can_reuse_epoch_itr(dataset) \
                or cfg.dataset.update_epoch_batch_itr:
            return fairseq_get_batch_iterator(dataset, **kwargs)
        first = dict(kwargs, epoch=FIRST_EPOCH)
        if cfg.dataset.update_ordered_indices_seed:  # fairseq passed seed + epoch
            first["seed"] = kwargs["seed"] - epoch + FIRST_EPOCH
        itr = fairseq_get_batch_iterator(dataset, **first)
        if task.dataset_to_epoch_iter.get(dataset) is not itr:
            # the task did not cache it after all (it batches per epoch itself): as fairseq
            return fairseq_get_batch_iterator(dataset, **kwargs)
        itr.epoch = epoch  # where fairseq's own iterator would stand (load_state_dict sets it)
        return itr

    task.get_batch_iterator = get_batch_iterator  # on this instance, for this call only
    try:
        yield
    finally:
        del task.get_batch_iterator


def replay_virtual_epochs(dataset, epoch: int) -> None:
    """translation_multi_simple_epoch with --virtual-epoch-size (SampledMultiEpochDataset):
    each pass over the sampled data draws its indices at the pass's first virtual epoch, seeded
    with that epoch, and later virtual epochs only move an offset. A dataset built for a resumed
    epoch draws them seeded with the resumed epoch instead (stock fairseq too). Replay the
    epochs before it, as the uninterrupted run did (only a pass's first epoch costs a draw)."""
    if getattr(dataset, "virtual_epoch_size", None) is None:
        return
    for earlier in range(FIRST_EPOCH, epoch):
        dataset.set_epoch(earlier)


# fairseq counts --patience in attributes of fairseq_cli.train.should_stop_early (the best score
# and the validations since it improved) and saves neither: a resumed run starts counting again
# and stops later than the uninterrupted one. Save and restore them with the checkpoint.
PATIENCE_KEY = "fsdp2_patience"


def _should_stop_early_functions() -> list:
    import fairseq_cli.train
    functions = [fairseq_cli.train.should_stop_early]
    main = sys.modules.get("__main__")  # `python -m fairseq_cli.train` runs a second copy
    if getattr(main, "should_stop_early", None) not in (None, *functions):
        functions.append(main.should_stop_early)
    return functions


def save_patience(cfg, extra_state: dict) -> None:
    if cfg.checkpoint.patience > 0:
        for function in _should_stop_early_functions():
            if getattr(function, "best", None) is not None:
                extra_state[PATIENCE_KEY] = {"best": float(function.best),
                                             "num_runs": int(function.num_runs)}


def restore_patience(extra_state: dict) -> None:
    saved = extra_state.get(PATIENCE_KEY)
    if saved:
        for function in _should_stop_early_functions():
            function.best, function.num_runs = saved["best"], saved["num_runs"]


def restores_iterator(checkpoint_cfg, filename: str) -> bool:
    """Whether fairseq's checkpoint_utils.load_checkpoint will restore the data loader's position
    from ``filename``'s extra state: not with --reset-dataloader, nor when the file is the
    --finetune-from-model it starts from (fairseq resets the data loader there)."""
    return not (checkpoint_cfg.reset_dataloader
                or filename == checkpoint_cfg.finetune_from_model)


def rescale_iterator_position(extra_state: dict, saved_world: int, now: int) -> None:
    """The saved position counts batches per rank; keep the same global position."""
    itr = extra_state.get("train_iterator") or {}
    done = itr.get("iterations_in_epoch", 0) * saved_world
    if saved_world == now or not done:
        return
    if done % now:
        raise CheckpointError(
            f"cannot resume mid-epoch at {now} ranks: the checkpoint (saved at "
            f"{saved_world} ranks) is {done} batches into the epoch, not a multiple of {now}")
    itr["iterations_in_epoch"] = done // now
    logger.info(f"resuming a {saved_world}-rank checkpoint on {now} ranks: "
                f"{done} batches into epoch {itr.get('epoch')}")
