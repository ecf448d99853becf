"""Option checks: one line, non-zero exit, before any work."""
import pytest

from fairseq_fsdp2.options import FSDP2DistributedTrainingConfig, OptionError, validate


def check(world=2, min_params=0, fp16=False, bf16=False, optimizer="adam",
          fp16_adam_stats=False, **options):
    validate(FSDP2DistributedTrainingConfig(**options), min_params_to_wrap=min_params,
             fp16=fp16, bf16=bf16, world_size=world, optimizer=optimizer,
             fp16_adam_stats=fp16_adam_stats)


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_params=-1), "--min-params-to-wrap must be >= 0"),
    (dict(fp16=True, bf16=True), "mutually exclusive"),
    (dict(world=4, fsdp2_replicate_degree=3), "does not divide the world size 4"),
    (dict(world=4, fsdp2_replicate_degree=0), "must be >= 1"),
    (dict(world=4, fsdp2_reshard_degree=3), "must divide the shard group size 4"),
    (dict(world=4, fsdp2_reshard_degree=4), "neither 1 nor 4"),
    (dict(world=4, fsdp2_reshard_degree=1), "neither 1 nor 4"),
    (dict(world=8, fsdp2_replicate_degree=2, fsdp2_reshard_degree=4), "shard group size 4"),
    (dict(world=4, fsdp2_reshard_degree=2, no_reshard_after_forward=True), "conflict"),
    (dict(bf16_adam_stats=True, fp16_adam_stats=True),
     "--bf16-adam-stats and --fp16-adam-stats conflict"),
    (dict(bf16_adam_stats=True, optimizer="adafactor"), "needs --optimizer adam"),
    (dict(eight_bit_adam_stats=True, fp16_adam_stats=True),
     "--eight-bit-adam-stats and --fp16-adam-stats conflict"),
    (dict(eight_bit_adam_stats=True, bf16_adam_stats=True),
     "--eight-bit-adam-stats and --bf16-adam-stats conflict"),
    (dict(eight_bit_adam_stats=True, optimizer="sgd"), "--eight-bit-adam-stats keeps Adam's "
                                                       "moments: it needs --optimizer adam"),
])
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(OptionError, match=message):
        check(**kwargs)


def test_good_values_pass():
    check(world=4, fsdp2_reshard_degree=2)
    check(world=4, fsdp2_replicate_degree=2, min_params=10)
    check(world=1)
    check(bf16=True, bf16_adam_stats=True)
    check(fp16=True, fp16_adam_stats=True)
    check(eight_bit_adam_stats=True)

# The same checks from the command line: tests/test_bad_input.py (docs/errors.md).


@pytest.mark.parametrize("flags, message", [
    (["--fsdp2-root-reshard", "sometimes"], "argument --fsdp2-root-reshard: invalid choice: "
                                            "'sometimes' (choose from 'default', 'always')"),
    (["--fp16", "--bf16"], "--fp16 and --bf16 are mutually exclusive: choose one")])
def test_a_program_parsing_a_bad_command_line_gets_the_error(flags, message, capsys):
    """fairseq's parser, given a list by a program (this test's process: no fairseq command
    runs it): the plugin's one-line error raised as an OptionError for the program to handle,
    nothing printed, the process not ended (a fairseq command prints the line and exits 2:
    tests/test_bad_input.py)."""
    import fairseq_fsdp2  # noqa: F401  (the plugin's options and parse errors)
    from fairseq import options
    with pytest.raises(OptionError) as raised:
        options.parse_args_and_arch(options.get_training_parser(), [
            "data", "--task", "translation", "--arch", "transformer", "--ddp-backend", "fsdp2",
            *flags])
    assert str(raised.value) == message
    assert capsys.readouterr().err == ""


def config_nodes(node, path: str = "") -> dict:
    """Every node of an OmegaConf config by its path: its class, declared type, object type,
    optionality and flags, and a leaf's value."""
    from omegaconf import DictConfig, ListConfig
    meta = node._metadata
    found = {path: (type(node), meta.ref_type, meta.object_type, meta.optional, meta.flags)}
    if node._is_none() or node._is_missing() or not isinstance(node, (DictConfig, ListConfig)):
        found[path] += (repr(node._value()),)
    else:
        items = node._content.items() if isinstance(node, DictConfig) else \
            enumerate(node._content)
        for key, child in items:
            found.update(config_nodes(child, f"{path}.{key}"))
    return found


def test_hydra_composes_from_the_schema_fairseqs_config_builds():
    """The plugin gives fairseq's stored hydra schema its distributed_training node instead of
    building the whole schema again (registration.py): what hydra loads is, node for node, what
    building it from FairseqConfig (which carries the plugin's options) gives, the group's own
    node too."""
    import fairseq_fsdp2  # noqa: F401  (the plugin's options in fairseq's config)
    from fairseq.dataclass.configs import FairseqConfig
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    for name, built in (("config", FairseqConfig),
                        ("distributed_training", FSDP2DistributedTrainingConfig)):
        stored = config_nodes(store.load(f"{name}.yaml").node)
        expected = config_nodes(OmegaConf.structured(built))
        assert stored == expected, [p for p in expected if stored.get(p) != expected[p]]
    assert FairseqConfig.__dataclass_fields__["distributed_training"].type is \
        FSDP2DistributedTrainingConfig
