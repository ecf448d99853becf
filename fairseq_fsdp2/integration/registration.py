"""Everything the plugin changes inside fairseq, in one place, each change with its reason.

Installed once, when ``--user-dir fairseq_fsdp2`` (or ``import fairseq_fsdp2``) imports the
package. fairseq-train imports the user dir before it builds its argument parser, so the new
backend value and options are known to argparse, to fairseq's OmegaConf validation and to hydra.
"""
from __future__ import annotations

import functools
import os
import sys

import fairseq.checkpoint_utils
import fairseq.dataclass.utils as fairseq_dataclass_utils
import fairseq.distributed.utils as fairseq_distributed_utils
import fairseq.file_io
import fairseq.hub_utils
import fairseq.options
import fairseq.tasks
import fairseq.tasks.translation_multi_simple_epoch
import fairseq_cli.train
from fairseq.dataclass import configs as fairseq_configs
from hydra.core.config_store import ConfigStore

from ..checkpoint.export import read_with_full_weights
from ..checkpoint.safe_load import allow_fairseq_checkpoint_classes
from ..command_line import parse_errors
from ..process import lifecycle, quiet, run_context
from ..options import FSDP2DistributedTrainingConfig
from ..sharding import meta_build
from ..trainer.fsdp2_trainer import select_trainer
from . import hub

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    # 0. Loaded too late: by --user-dir in a list of arguments whose parser fairseq built
    #    before the plugin existed (a Python program; fairseq-train imports --user-dir first).
    #    One line naming the fix, instead of argparse's "invalid choice: 'fsdp2'"; nothing is
    #    installed, so `import fairseq_fsdp2` afterwards installs the plugin as usual.
    parse_errors.check_not_loaded_mid_parse(fairseq.options.parse_args_and_arch.__code__)
    _installed = True

    # 1. Options: fairseq builds the `distributed_training` group of its argparse parser, its
    #    OmegaConf schema and its hydra nodes from DistributedTrainingConfig. Point all three at
    #    the subclass carrying the `fsdp2` backend value and the plugin's options.
    field = fairseq_configs.FairseqConfig.__dataclass_fields__["distributed_training"]
    field.type = FSDP2DistributedTrainingConfig
    field.default = FSDP2DistributedTrainingConfig
    fairseq_configs.FairseqConfig.__annotations__["distributed_training"] = \
        FSDP2DistributedTrainingConfig
    fairseq.options.DistributedTrainingConfig = FSDP2DistributedTrainingConfig
    #    fairseq stored its hydra nodes at import (hydra_init): the whole config's schema
    #    ("config") and a node per group, distributed_training among them. Store that group's
    #    node again, and build the schema's distributed_training node again in the stored
    #    schema, as building the schema builds each field's (OmegaConf's own step for it; an
    #    assignment would keep the old field's type): the schema that building all of it again
    #    from FairseqConfig gives (tests/test_options.py), for 0.007 of the 0.028 CPU-s that
    #    costs in every process loading the plugin (hydra_init would build every group again).
    store = ConfigStore.instance()
    store.store(name="distributed_training", node=FSDP2DistributedTrainingConfig)
    # private (OmegaConf's DictConfig._wrap_value_and_set; no public way to re-type a field's
    # node in place; listed in tests/test_private_torch.py)
    store.repo["config.yaml"].node._wrap_value_and_set(
        "distributed_training", FSDP2DistributedTrainingConfig, FSDP2DistributedTrainingConfig)

    # 2. Trainer: fairseq_cli.train.main looks up `Trainer` when it runs; select ours for fsdp2.
    #    `python -m fairseq_cli.train` runs that file as __main__, a second module object.
    fairseq_cli.train.Trainer = select_trainer
    main_module = sys.modules.get("__main__")
    if os.path.abspath(getattr(main_module, "__file__", "") or "") == \
            os.path.abspath(fairseq_cli.train.__file__):
        main_module.Trainer = select_trainer

    # 3. Launch: fairseq_cli.train and hydra_train start through distributed_utils.call_main;
    #    wrap it to set up torchrun/single-process/gloo launches, check options first, tear the
    #    run down when it ends and report failures (process/lifecycle.py).
    original = fairseq_distributed_utils.call_main
    fairseq_distributed_utils.call_main = functools.wraps(original)(
        functools.partial(lifecycle.call_main, original))

    # 4. Loading: fairseq calls torch.load with torch's default weights_only=True, which refuses
    #    the argparse.Namespace fairseq pickles. Allow-list it (never switch the safety off).
    allow_fairseq_checkpoint_classes()

    # 5. Parsing: argparse prints fairseq's whole usage (about 120 lines) before a bad flag
    #    value's error, and fairseq turns --bf16 into --tpu, so `--fp16 --bf16` fails with
    #    "Cannot combine --fp16 and --tpu" and a traceback. FSDP2 runs, and a bad value of one of
    #    the plugin's own flags in any run, get the real error alone in one line, exit status 2
    #    (command_line/parse_errors.py).
    fairseq.options.parse_args_and_arch = functools.wraps(fairseq.options.parse_args_and_arch)(
        functools.partial(parse_errors.parse_args_and_arch, fairseq.options.parse_args_and_arch))

    # 6. Model construction: fairseq builds the full model, randomly initialised, on every
    #    rank; for FSDP2 runs that load their weights it is built on the meta device instead
    #    (sharding/meta_build.py). Both base classes of fairseq's tasks implement build_model.
    for task_class in (fairseq.tasks.FairseqTask, fairseq.tasks.LegacyFairseqTask):
        task_class.build_model = _meta_aware(task_class.build_model)

    # 7. Saving, in FSDP2 runs (other backends copy as stock fairseq does): fairseq writes a
    #    checkpoint atomically (temp file, then rename) but then copies it over
    #    checkpoint_last.pt / checkpoint_best.pt in place, so a kill during the copy leaves a
    #    truncated file where the previous good one was: copy to a temp name and rename. And
    #    with --write-checkpoints-asynchronously (checkpoint/async_save.py) fairseq's first
    #    file is written only once its shards are complete, so a copy of it asked for before
    #    then is written with it instead.
    fairseq.file_io.PathManager.copy = staticmethod(
        functools.partial(_copy_in_fsdp2_runs, fairseq.file_io.PathManager.copy))

    # 8. Reading for inference: fairseq-generate, -validate, -interactive and fairseq's other
    #    readers of a checkpoint file go through load_checkpoint_to_cpu; an FSDP2 checkpoint's
    #    model entry only references its shard directory, which they cannot load ("Unexpected
    #    key(s) in state_dict: fsdp2_sharded"). Outside the FSDP2 trainer, which reads its own
    #    shards, give them the full weights read from that directory.
    fairseq.checkpoint_utils.load_checkpoint_to_cpu = functools.wraps(
        fairseq.checkpoint_utils.load_checkpoint_to_cpu)(functools.partial(
            read_with_full_weights, fairseq.checkpoint_utils.load_checkpoint_to_cpu))

    # 9. Quiet config building: every fairseq command (fairseq-train, -generate, the hub,
    #    reading an old checkpoint) builds its config with hydra.experimental's initialize and
    #    compose(strict=False) over config files written for Hydra 1.0, and Hydra 1.3 prints
    #    about 20 lines of deprecation notices each time, about fairseq's code, which the user
    #    cannot act on. Silence exactly those (process/quiet.py), during these two calls only
    #    (initialize's config_path is relative to its caller: one frame more, said to hydra).
    fairseq_dataclass_utils.initialize = quiet.hydra_initialize_silenced(
        fairseq_dataclass_utils.initialize)
    fairseq_dataclass_utils.compose = quiet.hydra_calls_silenced(fairseq_dataclass_utils.compose)

    # 10. The hub with NLLB's task (integration/hub.py): fairseq's GeneratorHubInterface passes
    #    prefix_allowed_tokens_fn to the task's build_generator, which
    #    translation_multi_simple_epoch's override does not take (TypeError on every
    #    translate()), and its text keeps the target language tag the task forces as the first
    #    token (fairseq-generate strips it, the hub does not). Take the keyword; make
    #    from_pretrained's hub (looked up in fairseq.hub_utils when called) strip the tag.
    multilingual = fairseq.tasks.translation_multi_simple_epoch.TranslationMultiSimpleEpochTask
    multilingual.build_generator = hub.build_generator_taking_prefix_fn(
        multilingual.build_generator)
    fairseq.hub_utils.GeneratorHubInterface = hub.LanguageTagHub


def _meta_aware(fairseq_build_model):
    @functools.wraps(fairseq_build_model)
    def build_model(task, cfg, *args, **kwargs):
        run = run_context.current()
        return meta_build.build_model(fairseq_build_model, task, cfg, *args,
                                      on_meta=run is not None and run.builds_on_meta, **kwargs)
    return build_model


def _copy_in_fsdp2_runs(copy, src_path: str, dst_path: str, overwrite: bool = False) -> bool:
    run = run_context.current()
    if run is None or "://" in dst_path:  # not an FSDP2 run, or a remote store (iopath's)
        return copy(src_path, dst_path, overwrite=overwrite)
    if run.saves is not None and run.saves.defer_copy(src_path, dst_path):
        return True
    tmp = f"{dst_path}.tmp"
    if not copy(src_path, tmp, overwrite=True):
        return False
    os.replace(tmp, dst_path)
    return True


def install_hydra_add_defaults(add_defaults) -> None:
    """For the hydra entry point only (hydra_train.py, hydra_config.py): fairseq's hydra main
    fills in the registered dataclasses' defaults with `add_defaults`, looked up when it runs, which
    cannot set up argparse-only tasks and architectures (translation_multi_simple_epoch, the
    NLLB archs). Use the entry point's version, which also converts those nodes."""
    import fairseq_cli.hydra_train
    fairseq_cli.hydra_train.add_defaults = add_defaults


def install_hydra_main(hydra_main) -> None:
    """For the hydra entry point only (hydra_train.py): fairseq's cli_main runs the module's
    ``hydra_main``, looked up when it runs, which drops the best validation score its
    ``_hydra_main`` returns; hydra's sweepers need it. Use the entry point's, which returns it."""
    import fairseq_cli.hydra_train
    fairseq_cli.hydra_train.hydra_main = hydra_main
