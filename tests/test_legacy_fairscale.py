"""Legacy FSDP's sharded checkpoints (fairseq ``--ddp-backend fully_sharded --use-sharded-state``,
fairscale's FullyShardedDataParallel) convert to one stock fairseq file.

The shard files are real: 2 gloo ranks run stock fairseq's own code with fairscale 0.4.13
(``fsdp_enable_wrap``/``fsdp_wrap`` as fairseq-train builds the model, ``Trainer``,
``checkpoint_utils.save_checkpoint``), which writes ``checkpoint_last-shard{0,1}.pt``. The one
change: fairscale's default compute device is CUDA; it is the CPU here. Building the wrappers
and saving works on the CPU, a training step does not (fairscale needs CUDA streams), so the
weights are the initial ones, compared with the same seed's unwrapped model. A small module
wrapped with fairscale directly covers what the transformer does not: odd sizes (padding),
``flatten_parameters=False``, ties inside a nested unit and one parameter under two names.

fairscale is a test-only requirement (requirements-dev.txt), installed by scripts/setup.sh into
.venv/fixture-deps, which only the ranks get on their path. This file is also their program:
``python -m test_legacy_fairscale CORPUS OUT``.
"""
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import FIXTURE_DEPS, TESTS, TINY_MODEL, TRAINING, need_fixture_dep
from launcher import run_command, run_ranks



def save_shards(corpus: str, out: str) -> None:
    """One rank: the transformer's shards as fairseq-train saves them, and the small module's
    local state and metadata with and without flattening; rank 0 also the full references."""
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fairscale_fsdp
    from fairscale.nn.data_parallel import FullyShardedDataParallel
    from fairseq import checkpoint_utils, options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import fsdp_enable_wrap, fsdp_wrap
    from fairseq.distributed import utils as dist_utils
    from fairseq.trainer import Trainer

    fairscale_fsdp._get_default_cuda_device = lambda module: torch.device("cpu")
    rank = int(os.environ["RANK"])
    args = [corpus, *TINY_MODEL, *TRAINING, "--ddp-backend", "fully_sharded",
            "--use-sharded-state", "--min-params-to-wrap", "1", "--save-dir", out,
            "--distributed-world-size", "2", "--distributed-rank", str(rank),
            "--distributed-init-method", "env://", "--distributed-no-spawn",
            "--distributed-backend", "gloo", "--no-epoch-checkpoints"]
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), args))
    cfg.distributed_training.distributed_rank = dist_utils.distributed_init(cfg)
    task = tasks.setup_task(cfg.task)

    def copy(state):  # wrapping frees the parameters' storage
        return {k: v.clone() for k, v in state.items()}
    references = {}
    utils.set_torch_seed(cfg.common.seed)
    references["transformer"] = copy(task.build_model(cfg.model).state_dict())
    utils.set_torch_seed(cfg.common.seed)
    with fsdp_enable_wrap(cfg.distributed_training):  # as fairseq_cli/train.py builds it
        model = fsdp_wrap(task.build_model(cfg.model))
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    epoch_itr = trainer.get_train_iterator(epoch=1)
    epoch_itr.next_epoch_itr()
    checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)

    for flatten in (True, False):
        torch.manual_seed(1)
        net = SmallNet()
        references[f"flatten={flatten}"] = copy(net.state_dict())
        net.inner = FullyShardedDataParallel(net.inner, flatten_parameters=flatten)
        net = FullyShardedDataParallel(net, flatten_parameters=flatten)
        torch.save({"model": net.local_state_dict(), "fsdp_metadata": net.local_metadata_dict()},
                   os.path.join(out, f"small-flatten={flatten}-shard{rank}.pt"))
    if rank == 0:
        torch.save(references, os.path.join(out, "references.pt"))


class SmallNet(torch.nn.Module):
    """Odd sizes (the last rank's shards are padded), a nested unit with ties inside it (one
    between differently named parameters, which fairscale records with the names swapped), a
    tie in the root unit, buffers (one not saved)."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.inner = nn.Module()
        self.inner.proj = nn.Linear(5, 7)
        self.inner.gate = nn.Linear(5, 7, bias=False)
        self.inner.gate.weight = self.inner.proj.weight
        self.inner.scale = nn.Parameter(torch.randn(3))
        self.inner.other = nn.Module()
        self.inner.other.register_parameter("alias", self.inner.scale)
        self.inner.register_buffer("steps", torch.tensor([3.0]))
        self.inner.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.head = nn.Linear(5, 3)
        self.head2 = nn.Linear(5, 3)
        self.head2.weight = self.head.weight
        self.register_buffer("version", torch.tensor([2.0]))


@pytest.fixture(scope="module")
def legacy_save(corpus, tmp_path_factory):
    need_fixture_dep("fairscale", "to write the shards")
    out = tmp_path_factory.mktemp("legacy")
    path = os.pathsep.join([str(TESTS), str(FIXTURE_DEPS), os.environ.get("PYTHONPATH", "")])
    results = run_ranks(2, lambda r: [corpus, out], module="test_legacy_fairscale",
                        env={"PYTHONPATH": path}, timeout=120,
                        fresh_interpreter=True)  # fairseq looks for fairscale at import
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.output[-4000:]}"
    return out, torch.load(out / "references.pt", weights_only=True)


@pytest.mark.slow
def test_consolidated_equals_the_model_and_stock_generate_reads_it(legacy_save, corpus, tmp_path):
    from fairseq_fsdp2.checkpoint import legacy_fairscale
    from fairseq_fsdp2.consolidate import main

    out, references = legacy_save
    shards = [str(out / "checkpoint_last-shard0.pt"), str(out / "checkpoint_last-shard1.pt")]
    for given in (shards[1], str(out / "checkpoint_last.pt"), str(out / "checkpoint_last")):
        assert legacy_fairscale.shard_files(given) == shards
    assert "fsdp_metadata" in torch.load(shards[0], weights_only=True)

    result = tmp_path / "consolidated.pt"
    assert main([shards[0], str(result)]) == 0
    state = torch.load(result, weights_only=True)
    weights, expected = state["model"], references["transformer"]
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    tied = {weights[k].data_ptr() for k in ("encoder.embed_tokens.weight",
                                            "decoder.embed_tokens.weight",
                                            "decoder.output_projection.weight")}
    assert len(tied) == 1  # every alias, as fairseq stores them (a strict load needs all three)
    assert "last_optimizer_state" not in state and "fsdp_metadata" not in state
    assert state["cfg"]["distributed_training"]["ddp_backend"] == "pytorch_ddp"

    # stock fairseq-generate (no --user-dir) loads it strictly; short outputs keep it quick
    proc = run_command("fairseq_cli.generate", corpus, "--path", result, "--gen-subset",
                       "valid", "--beam", "1", "--max-len-a", "0", "--max-len-b", "2",
                       "--max-tokens", "4000", "--cpu")
    assert proc.returncode == 0, proc.output[-2000:]
    assert sum(l.startswith("H-") for l in proc.output.splitlines()) > 90


@pytest.mark.slow
@pytest.mark.parametrize("flatten", [True, False])
def test_padding_ties_and_buffers(legacy_save, flatten):
    from fairseq_fsdp2.checkpoint.legacy_fairscale import consolidate_shard_weights

    out, references = legacy_save
    states = [torch.load(out / f"small-flatten={flatten}-shard{r}.pt", weights_only=True)
              for r in (0, 1)]
    paddings = [p["padding"] for s in states for u in s["fsdp_metadata"]["param_metadata"]
                for p in u["params"].values()]
    assert any(paddings)  # odd sizes: the fixture does exercise the padding
    weights = consolidate_shard_weights([s["model"] for s in states],
                                        [s["fsdp_metadata"] for s in states])
    expected = references[f"flatten={flatten}"]
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    for a, b in [("inner.gate.weight", "inner.proj.weight"), ("head2.weight", "head.weight"),
                 ("inner.other.alias", "inner.scale")]:
        assert weights[a] is weights[b]


@pytest.mark.slow
def test_incomplete_or_mixed_shards_are_refused_with_one_line(legacy_save, tmp_path, capsys):
    from fairseq_fsdp2.consolidate import main

    out, _ = legacy_save
    names = ["checkpoint_last-shard0.pt", "checkpoint_last-shard1.pt"]
    missing, mixed = tmp_path / "missing", tmp_path / "mixed"
    for d in (missing, mixed):
        d.mkdir()
        for n in names:
            shutil.copy(out / n, d / n)
    (missing / names[1]).unlink()
    later = torch.load(mixed / names[1], weights_only=True)
    later["optimizer_history"][-1]["num_updates"] = 7
    torch.save(later, mixed / names[1])
    cases = [
        (missing / names[0], f"shard file missing: {missing / names[1]} (the save has 2 shards"),
        (mixed / "checkpoint_last.pt", f"shards are not from the same save: {mixed / names[1]} "
                                       "is at update 7"),
    ]
    for given, message in cases:
        result = tmp_path / "out.pt"
        assert main([str(given), str(result)]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"fairseq_fsdp2: error: {message}"), lines
        assert not result.exists() and not Path(str(result) + ".tmp").exists()


if __name__ == "__main__":
    save_shards(sys.argv[1], sys.argv[2])
