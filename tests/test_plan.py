"""The sharding plan, computed in one process on real fairseq models (no collectives)."""
import pytest
import torch.nn as nn
from fairseq import options, tasks

import fairseq_fsdp2  # noqa: F401
from fairseq_fsdp2.sharding.plan import LAYER, ROOT, SHARED, PlanError, build_plan, tied_groups
from conftest import TINY_MODEL


@pytest.fixture(scope="module")
def model(corpus):
    args = options.parse_args_and_arch(options.get_training_parser(),
                                       [str(corpus), *TINY_MODEL])
    return tasks.setup_task(args).build_model(args)


def test_threshold_wraps_each_layer_at_or_above_it(model):
    layer_params = sum(p.numel() for p in model.encoder.layers[0].parameters())
    plan = build_plan(model, world_size=2, min_params_to_wrap=layer_params)
    names = [u.name for u in plan.layer_units]
    # encoder layers have exactly the threshold; decoder layers (cross-attention) have more
    assert names == ["encoder.layers.0", "encoder.layers.1", "decoder.layers.0",
                     "decoder.layers.1"]
    above = build_plan(model, world_size=2, min_params_to_wrap=layer_params + 1)
    assert [u.name for u in above.layer_units] == ["decoder.layers.0", "decoder.layers.1"]


def test_units_partition_the_parameters(model):
    plan = build_plan(model, world_size=2, min_params_to_wrap=1)
    assert sum(u.num_params for u in plan.units) == plan.total_params
    assert plan.total_params == sum(p.numel() for p in model.parameters())
    assert plan.units[-1].kind == ROOT


def test_shared_embedding_is_one_grouped_unit(model):
    plan = build_plan(model, world_size=2, min_params_to_wrap=1)
    shared = [u for u in plan.units if u.kind == SHARED]
    assert len(shared) == 1
    assert set(shared[0].module_paths) == {"encoder.embed_tokens", "decoder.output_projection"}
    assert shared[0].num_params == model.encoder.embed_tokens.weight.numel()


def test_no_wrap_warning_only_when_nothing_is_wrapped_on_several_ranks(model):
    nothing = build_plan(model, world_size=2, min_params_to_wrap=int(1e8))
    assert nothing.layer_units == []
    assert len(nothing.warnings) == 1 and "wraps no layer" in nothing.warnings[0]
    assert "wraps no layer" not in nothing.table()  # the trainer logs it, once (test_backend)
    assert build_plan(model, world_size=1, min_params_to_wrap=int(1e8)).warnings == []
    assert build_plan(model, world_size=2, min_params_to_wrap=1).warnings == []


def test_checkpoint_activations_wraps_every_layer_as_fairseq_does(model):
    plan = build_plan(model, world_size=2, min_params_to_wrap=int(1e8),
                      checkpoint_activations=True)
    assert len(plan.layer_units) == 4


def test_layerdrop_lists_wrap_every_layer_in_training_mode(corpus):
    """fairseq's LayerDropModuleList (--encoder/--decoder-layerdrop) yields a random subset of
    its layers when iterated in training mode: the plan takes its children, all of them, under
    their own names (p = 1 would skip every layer of an iteration)."""
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(corpus), *TINY_MODEL, "--encoder-layerdrop", "1", "--decoder-layerdrop", "1"])
    model = tasks.setup_task(args).build_model(args).train()
    assert list(model.encoder.layers) == []  # what iterating would give
    plan = build_plan(model, world_size=2, min_params_to_wrap=1)
    assert [u.name for u in plan.layer_units] == ["encoder.layers.0", "encoder.layers.1",
                                                  "decoder.layers.0", "decoder.layers.1"]


def test_reshard_settings(model):
    default = build_plan(model, world_size=4, min_params_to_wrap=1)
    kinds = {u.kind: u.reshard_after_forward for u in default.units}
    assert kinds == {LAYER: True, SHARED: False, ROOT: None}
    always = build_plan(model, world_size=4, min_params_to_wrap=1, root_reshard="always")
    assert {u.kind: u.reshard_after_forward for u in always.units} == \
        {LAYER: True, SHARED: True, ROOT: True}
    kept = build_plan(model, world_size=4, min_params_to_wrap=1, no_reshard_after_forward=True)
    assert {u.reshard_after_forward for u in kept.layer_units} == {False}
    degree = build_plan(model, world_size=4, min_params_to_wrap=1, reshard_degree=2)
    assert {u.reshard_after_forward for u in degree.layer_units} == {2}
    table = degree.table()
    assert "to groups of 2 ranks" in table and "PyTorch default for the root" in table


def test_table_lists_every_unit_with_its_share(model):
    plan = build_plan(model, world_size=2, min_params_to_wrap=1)
    lines = plan.table().splitlines()
    # heading, header, rule, one row a unit, the modules a task may call on their own
    assert len(lines) == 4 + len(plan.units)
    assert lines[-1].endswith("(then gathered with the root unit): encoder, decoder")
    assert "encoder.layers.0" in lines[3] and "%" in lines[1]


class _TiedAcrossLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 10)])
        self.layers[0].weight = self.embed.weight


def test_tie_crossing_a_layer_unit_is_refused():
    between_layers = nn.Module()
    between_layers.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    between_layers.layers[1].weight = between_layers.layers[0].weight
    with pytest.raises(PlanError, match="layers.0, layers.1 crosses a layer unit"):
        build_plan(between_layers, world_size=2, min_params_to_wrap=1)
    m = _TiedAcrossLayer()
    assert tied_groups(m) == [["embed", "layers.0"]]
    with pytest.raises(PlanError, match="crosses a layer unit"):
        build_plan(m, world_size=2, min_params_to_wrap=1)
    # below the threshold the layer stays unwrapped and the tie is grouped instead
    plan = build_plan(m, world_size=2, min_params_to_wrap=10 ** 6)
    assert [u.module_paths for u in plan.units if u.kind == SHARED] == [("embed", "layers.0")]


def test_entries_are_the_roots_children_with_parameters_or_a_containers_children(model):
    """What a task may call on its own (plan.py): here the encoder and decoder; a multi-model's
    sub-models in place of its ModuleDict; not a unit, which gathers itself."""
    assert build_plan(model, world_size=2, min_params_to_wrap=1).entries == ("encoder",
                                                                             "decoder")
    multi = nn.Module()
    multi.models = nn.ModuleDict({"a-b": nn.Linear(2, 2), "b-a": nn.Linear(2, 2)})
    multi.buffers_only = nn.Module()
    plan = build_plan(multi, world_size=2, min_params_to_wrap=1)
    assert plan.entries == ("models.a-b", "models.b-a")
    assert "then gathered with the root unit): models.a-b, models.b-a" in plan.table()
    multi.layers = nn.ModuleList([nn.Linear(2, 2)])  # a layer unit of the root: no entry
    assert build_plan(multi, world_size=2, min_params_to_wrap=1).entries == (
        "models.a-b", "models.b-a")


def _shared_by_layers() -> nn.Module:
    """A module every layer holds a reference to (as latent depth's layer_select)."""
    m = nn.Module()
    m.select = nn.Linear(2, 2)
    m.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)) for _ in range(2)])
    for layer in m.layers:
        layer.select = m.select
    return m


def test_a_module_in_several_units_is_refused_and_a_shared_encoder_is_not():
    with pytest.raises(PlanError, match=r"module layers.0.select is also layers.1.select, "
                                        r"select: one module in several FSDP2 units "
                                        r"\(layers.0, layers.1, root\)"):
        build_plan(_shared_by_layers(), world_size=2, min_params_to_wrap=1)
    # without layer units it stays in the root: accepted
    plan = build_plan(_shared_by_layers(), world_size=2, min_params_to_wrap=10 ** 6)
    assert [u.kind for u in plan.units] == [ROOT]
    # an encoder shared by two sub-models: its layers are the same units under both paths
    encoder = nn.Module()
    encoder.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    encoder.norm = nn.LayerNorm(2)
    multi = nn.Module()
    multi.models = nn.ModuleDict({"a": nn.Module(), "b": nn.Module()})
    multi.models["a"].encoder = multi.models["b"].encoder = encoder
    plan = build_plan(multi, world_size=2, min_params_to_wrap=1)
    assert [u.name for u in plan.layer_units] == ["models.a.encoder.layers.0",
                                                  "models.a.encoder.layers.1"]
    assert plan.entries == ("models.a", "models.b")
