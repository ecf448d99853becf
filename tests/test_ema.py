"""--store-ema under FSDP2 (trainer/ema.py): the EMA kept as shards, against stock fairseq's 2-rank
``legacy_ddp --store-ema`` on the same command line.

One scenario (conftest's tiny model, --ema-decay 0.8 --ema-start-update 3 --ema-update-freq 2
--ema-fp32, 6 updates, a save after every update) runs under both backends; the tests read the
EMA and the weights of every save. fairseq's schedule (which updates step the EMA, with which
decay) comes from fairseq's own ``EMA.step``; its update of a tensor is
``ema.mul_(decay).add_(weights, alpha=1 - decay)`` (``EMA._step_internal``).

Tolerances. Replaying that update on the same saved tensors repeats the same two float
operations, but not always along the same kernel path: a vectorised loop and its scalar tail may
round the decay, or fuse the multiply-add, differently (seen with fp16 EMAs: 1-2 ulp), and the
shards put each element elsewhere in the loop. Each operation then differs by at most one
rounding of its operands and result, so the replayed update is within
6 u (|decay x ema| + |(1 - decay) x weights|) of the trained run's (u: the EMA's unit roundoff;
two roundings and a rounded scalar per operation, with room to spare): ``rounding_bound``.
Measured: 0 in fp32. Across backends, the two runs' weights differ by their gradients' summation
order: the scenario trains with plain SGD, under which that difference is bounded element by
element (numerics.sgd_reordered_bound; under Adam a gradient that is rounding noise becomes an
lr-sized step that the runs do not share); an EMA is a convex combination of the weights it
averaged, so it differs by no more than they do.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fairseq import checkpoint_utils
from fairseq.dataclass.configs import EMAConfig
from fairseq.models.ema import EMA

from conftest import SHORT_GENERATION
from launcher import run_command
from numerics import U16, U32, clipped_norms, sgd_reordered_bound
from scenarios import (assert_resumed_exactly, assert_same_training, resumed_at,
                       tiny_model_scenario, updates)

import fairseq_fsdp2  # noqa: F401  (allow-lists the classes fairseq pickles for torch.load)
from fairseq_fsdp2.checkpoint.export import consolidate, full_ema, full_tensors
from fairseq_fsdp2.checkpoint.safe_load import read_checkpoint_file
from fairseq_fsdp2.consolidate import main as consolidate_main
from fairseq_fsdp2.errors import CheckpointError
from fairseq_fsdp2.hf.nllb_weights import HFWeights

DECAY, START, FREQ, UPDATES, LR = 0.8, 3, 2, 6, 1e-3
EMA_FLAGS = ["--store-ema", "--ema-decay", DECAY, "--ema-start-update", START,
             "--ema-update-freq", FREQ, "--ema-fp32"]
SCENARIO = [*EMA_FLAGS, "--optimizer", "sgd", "--lr", LR, "--max-tokens", "500", "--log-format", "json", "--disable-validation",
            "--max-update", UPDATES, "--save-interval-updates", "1"]
#: conftest's tiny model shares one embedding among three names
TIED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
        "decoder.output_projection.weight")
FINAL_NORMS = tuple(f"{side}.layer_norm.{p}" for side in ("encoder", "decoder")
                    for p in ("weight", "bias"))


class Schedule(EMA):
    """fairseq's EMA with its update recorded instead of made: ``steps`` maps each update at
    which fairseq's ``step`` updates the EMA to the decay it uses."""

    def __init__(self, config):  # fairseq's copies a model; only the schedule is wanted
        self.config, self.decay, self.update_freq_counter, self.steps = config, 0.0, 0, {}

    def _step_internal(self, new_model, updates=None):
        self.steps[updates] = self.decay


def fairseq_schedule(decay=DECAY, start=START, freq=FREQ, updates=UPDATES,
                     first=1) -> dict[int, float]:
    schedule = Schedule(EMAConfig(store_ema=True, ema_decay=decay, ema_start_update=start,
                                  ema_update_freq=freq))
    for n in range(first, updates + 1):
        schedule.step(None, n)
    return schedule.steps


def fairseq_update(ema: torch.Tensor, weights: torch.Tensor, decay: float,
                   times: int = 1) -> torch.Tensor:
    """fairseq's update of one tensor (``times`` over: fairseq repeats it for each name of a
    tied weight)."""
    out = ema.clone()
    for _ in range(times):
        out.mul_(decay).add_(weights.to(out.dtype), alpha=1 - decay)
    return out


def rounding_bound(ema: torch.Tensor, weights: torch.Tensor, decay: float) -> torch.Tensor:
    """Elementwise bound between two evaluations of ``fairseq_update`` (module docstring)."""
    u = {torch.float32: U32, torch.float16: U16}[ema.dtype]
    return 6 * u * (decay * ema.float().abs() + (1 - decay) * weights.float().abs())


def saved(path: Path) -> tuple[dict, dict]:
    """(weights, EMA) of a checkpoint, full tensors by name: from the shards of an FSDP2
    checkpoint, as stored in a stock one."""
    state = read_checkpoint_file(str(path))
    if "fsdp2" in state:
        return full_tensors(str(path), state, "model"), full_ema(str(path), state)
    return state["model"], state["extra_state"]["ema"]


def saves(save_dir: Path, n: int = UPDATES) -> dict[int, tuple[dict, dict]]:
    return {u: saved(save_dir / f"checkpoint_1_{u}.pt") for u in range(1, n + 1)}


def check_updates(runs: dict[int, tuple[dict, dict]], steps: dict[int, float], keys,
                  times: int = 1, weights_dtype=None) -> float:
    """Every saved EMA from the save before it, by fairseq's schedule (``steps``) and update:
    unchanged where fairseq does not step, updated with the weights (in ``weights_dtype``: the
    model's dtype in fairseq) where it does. Returns the largest difference / bound."""
    worst, first = 0.0, min(runs)
    for n in sorted(runs)[1:]:
        (_, before), (weights, after) = runs[n - 1], runs[n]
        for key in keys:
            w = weights[key] if weights_dtype is None else weights[key].to(weights_dtype)
            if n not in steps:
                assert torch.equal(after[key], before[key]), (n, key)
                continue
            want = fairseq_update(before[key], w, steps[n], times)
            diff = (after[key].float() - want.float()).abs()
            bound = rounding_bound(before[key], w, steps[n]) * times
            assert (diff <= bound).all(), (n, key, diff.max().item())
            worst = max(worst, (diff / bound.clamp_min(1e-30)).max().item())
    assert first + 1 in runs
    return worst


@pytest.fixture(scope="module")
def ema(corpus, tmp_path_factory):
    return tiny_model_scenario(corpus, tmp_path_factory, "ema", SCENARIO)


@pytest.fixture(scope="module")
def ours(ema):
    return saves(ema.save_dir("fsdp2"))


@pytest.fixture(scope="module")
def stock(ema):
    return saves(ema.save_dir("stock"))


def test_ema_follows_fairseqs_schedule_and_update_and_equals_stock_legacy_ddp(ema, ours, stock):
    """Every save's EMA follows fairseq's schedule and update (within ``rounding_bound``), on
    every tensor, the tied embedding and the final layer norms included; the decay logged at
    each update is stock's; and after 6 updates the EMA equals stock legacy_ddp's within the
    weights' own difference."""
    assert_same_training(updates(ema.fsdp2), updates(ema.stock))
    logged = [{r["num_updates"]: r["ema_decay"] for r in map(json.loads, (
        line.split("| train_inner | ", 1)[1] for line in out.splitlines()
        if "| train_inner | " in line))} for out in (ema.fsdp2, ema.stock)]
    assert logged[0] == logged[1] and len(logged[0]) == UPDATES, logged
    steps = fairseq_schedule()
    assert steps == {2: 0, 4: DECAY, 6: DECAY}  # before --ema-start-update: decay 0 (a copy)
    weights, first = ours[1]
    keys = [k for k in first if "version" not in k]
    # fairseq's EMA starts as a copy of the model when it first steps (update 1)
    assert all(torch.equal(first[k], weights[k]) for k in first), "EMA at update 1"
    print(f"EMA vs fairseq's update replayed: {check_updates(ours, steps, keys):.2f} "
          f"x the rounding bound at most")
    assert all(torch.equal(e[k], w[k]) for w, e in ours.values() for k in e if "version" in k)

    # stock: the same on the tensors its EMA keeps right (test_stock_ema_faults below)
    stock_keys = [k for k in keys if k in stock[UPDATES][1] and k not in TIED]
    check_updates(stock, steps, stock_keys)
    # An EMA is a convex combination of the weights it averaged (each within
    # sgd_reordered_bound of stock's, which grows with the updates: the bound after the last
    # update covers every earlier one), plus the rounding of each run's 3 updates
    # (rounding_bound each). No element is exempt (SGD: module docstring).
    norms = clipped_norms([gnorm for _, (_, gnorm) in sorted(updates(ema.stock).items())],
                          clip=1.0)  # conftest's --clip-norm
    assert len(norms) == UPDATES
    a, b = ours[UPDATES][1], stock[UPDATES][1]
    worst = 0.0
    for key in stock_keys:
        diff = (a[key] - b[key]).abs()
        bound = sgd_reordered_bound(LR, norms, stock[UPDATES][0][key]) + \
            2 * len(steps) * rounding_bound(b[key], b[key], DECAY)
        assert (diff <= bound).all(), (key, diff.max().item(), (diff / bound).max().item())
        worst = max(worst, (diff / bound).max().item())
    print(f"EMA vs stock legacy_ddp's after {UPDATES} SGD updates: largest difference "
          f"{worst:.2e} x the bound")


def test_ema_is_sharded_like_the_model_no_rank_holds_a_full_copy(ema):
    """Each rank keeps and saves only its part of the EMA: in the last save's shards, the EMA of
    every parameter is stored in the pieces the parameter is, one per rank, each in its own
    rank's file (a copy held whole by a rank would be stored whole, once)."""
    save = ema.save_dir("fsdp2")
    shards = torch.load(save / "checkpoint_last.pt", weights_only=True)["fsdp2"]["shards"]
    metadata = dcp.FileSystemReader(str(save / shards)).read_metadata()
    files = defaultdict(set)
    for index, info in metadata.storage_data.items():
        files[index.fqn].add(info.relative_path)

    def pieces(key):
        return [(tuple(c.offsets), tuple(c.sizes))
                for c in metadata.state_dict_metadata[key].chunks]
    split = [key[len("model."):] for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and len(md.chunks) == 2]
    assert len(split) > 80, split  # every weight and bias of the tiny model
    for name in split:
        assert pieces(f"ema.{name}") == pieces(f"model.{name}"), name
        assert len(files[f"ema.{name}"]) == 2, (name, files[f"ema.{name}"])


def test_stock_ema_faults_the_sharded_ema_does_not_share(ours, stock):
    """fairseq 0.12's EMA decays a tied weight once per name (its updates run over the state
    dict, where the three names share one tensor: decay^3 per step), and drops the final layer
    norms of a pre-norm model (its ``restore`` leaves out the version keys, so the model's
    upgrade takes the EMA for a pre-2019 state and removes ``encoder.layer_norm`` and
    ``decoder.layer_norm``, setting the version to 1). The sharded EMA decays each tensor once
    (checked above) and keeps the layer norms and the version."""
    steps = fairseq_schedule()
    check_updates(stock, steps, [TIED[0]], times=len(TIED))
    with pytest.raises(AssertionError):  # and not once
        check_updates(stock, steps, [TIED[0]])
    weights, stock_ema = stock[UPDATES]
    assert not set(FINAL_NORMS) & set(stock_ema) and set(FINAL_NORMS) <= set(weights)
    assert stock_ema["encoder.version"].item() == 1 and weights["encoder.version"].item() == 3
    assert set(FINAL_NORMS) <= set(ours[UPDATES][1])
    assert ours[UPDATES][1]["encoder.version"].item() == 3


@pytest.fixture(scope="module")
def resumed(ema):
    """Killed (every rank) in update 4, rerun: the rerun's output and its saves of updates 4-6
    (weights, EMA). The killed run starts from the uninterrupted run's save of update 2
    (--restore-file, the same world size: resumed exactly, as the rerun is), so it makes update
    3 and its save only, not updates 1-3; the rerun (the command without --restore-file)
    resumes from that save. The rerun writes its saves in the background
    (--write-checkpoints-asynchronously: test_asynchronous_saves_hold_the_same_ema), which
    changes how a save is written, not what is resumed from or trained; the killed run's save
    stays synchronous (a kill during a background write leaves no save of update 3)."""
    ema.run("killed", "--restore-file", ema.save_dir("fsdp2") / "checkpoint_1_2.pt",
            fault="forward:4:all")
    out = ema.run("killed", "--write-checkpoints-asynchronously")
    return out, {n: saved(ema.save_dir("killed") / f"checkpoint_1_{n}.pt") for n in (4, 5, 6)}


def test_ema_resumes_exactly_after_a_kill(ema, ours, resumed):
    """Killed (every rank) in update 4, rerun (``resumed``): resumed from update 3's save,
    every update and the EMA of every later save equal the uninterrupted run's, bit for bit.
    The EMA steps at update 4 because the --ema-update-freq count (1 at update 3) was saved
    with it; stock fairseq keeps it in memory only, so its resumed run would step at update
    5."""
    out, again = resumed
    assert resumed_at(out) == 3
    assert_resumed_exactly(updates(out), updates(ema.fsdp2), 4)
    for n in (4, 5, 6):
        assert all(torch.equal(again[n][1][k], ours[n][1][k]) for k in ours[n][1]), n
    assert not all(torch.equal(ours[4][1][k], ours[3][1][k]) for k in ours[3][1])


def test_ema_resharded_on_one_rank(ema, ours):
    """The 2-rank save of update 4 resumed on 1 rank for update 5, at which fairseq's schedule
    does not step the EMA: the EMA saved at update 5 (and written to its consolidated export)
    is the 2-rank EMA of update 4, bit for bit."""
    out = ema.run("one-rank", "--restore-file", ema.save_dir("fsdp2") / "checkpoint_1_4.pt",
                  "--max-update", 5, ranks=1)
    assert resumed_at(out) == 4 and sorted(updates(out)) == [5]
    assert 5 not in fairseq_schedule()
    save = ema.save_dir("one-rank")
    exported = torch.load(save / "checkpoint_last_consolidated.pt",
                          weights_only=True)["extra_state"]["ema"]
    for resumed in (saved(save / "checkpoint_1_5.pt")[1], exported):
        assert set(resumed) == set(ours[4][1])
        assert all(torch.equal(resumed[k], ours[4][1][k]) for k in resumed)


def test_asynchronous_saves_hold_the_same_ema(ours, resumed):
    """--write-checkpoints-asynchronously writes the EMA's shards in the background with the
    model's (staged before the next optimizer step, which fairseq's EMA update follows): every
    save holds the synchronous run's weights and EMA, bit for bit. The resumed run's saves
    (``resumed``: updates 4-6, as the uninterrupted run makes them) cover each case where a
    save could take later values: after update 4 the next update changes the weights only (the
    EMA does not step at 5), after update 5 the EMA steps with the decay at 6, and the run's end
    waits for the save of update 6. (Saves where the EMA is a copy of the weights, updates 1-2,
    would not tell the EMA from the weights.)"""
    out, background = resumed
    steps = fairseq_schedule()
    assert [n in steps for n in (4, 5, 6)] == [True, False, True] and steps[6] == DECAY
    assert sorted(updates(out)) == [4, 5, 6] and "in the background" in out
    for n in (4, 5, 6):
        for got, want in zip(background[n], ours[n]):
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), n


def test_consolidated_export_holds_the_ema_where_fairseq_puts_it(ema, ours, stock, corpus,
                                                                 tmp_path):
    """The export at the end of the run holds the EMA in extra_state["ema"] (and, with
    --ema-fp32, extra_state["ema_fp32_params"]) under every name of the model, as fairseq's
    Trainer saves it; fairseq's own reader (checkpoint_utils.load_ema_from_checkpoint, behind
    --ema-seed-model) gets it, and fairseq's readers of the sharded checkpoint get it full. ``consolidate --ema`` exports it as the model: stock
    fairseq-generate runs it, and --format hf writes it for Hugging Face."""
    save = ema.save_dir("fsdp2")
    want = ours[UPDATES][1]
    export = save / "checkpoint_last_consolidated.pt"
    extra = torch.load(export, weights_only=True)["extra_state"]
    assert set(extra["ema"]) == set(stock[UPDATES][0])  # every name of the model
    # fairseq's readers of the sharded file itself (registration.py's patch 8) get it too
    read = checkpoint_utils.load_checkpoint_to_cpu(str(save / "checkpoint_last.pt"))
    for entry in (extra["ema"], extra["ema_fp32_params"], read["extra_state"]["ema"],
                  checkpoint_utils.load_ema_from_checkpoint(str(export))["model"]):
        assert set(entry) == set(want) and all(torch.equal(entry[k], want[k]) for k in want)
    assert extra["ema"]["decoder.output_projection.weight"].data_ptr() == \
        extra["ema"]["encoder.embed_tokens.weight"].data_ptr()  # tied, as fairseq stores it

    as_model = tmp_path / "ema.pt"
    assert consolidate_main(["--ema", str(save / "checkpoint_last.pt"), str(as_model)]) == 0
    state = torch.load(as_model, weights_only=True)
    assert all(torch.equal(state["model"][k], want[k]) for k in want)
    assert "ema" not in state["extra_state"] and "ema_fp32_params" not in state["extra_state"]
    generate = run_command("fairseq_cli.generate", corpus, "--path", as_model, "--gen-subset",
                           "valid", "--beam", "1", "--max-tokens", "2000", "--cpu",
                           *SHORT_GENERATION)
    assert generate.returncode == 0, generate.output[-2000:]
    assert sum(line.startswith("H-") for line in generate.output.splitlines()) > 90

    hf = tmp_path / "hf"
    assert consolidate_main(["--ema", str(save / "checkpoint_last.pt"), str(hf),
                             "--format", "hf"]) == 0
    back = HFWeights(str(hf))
    assert set(back) and all(torch.equal(back[k], want[k]) for k in back)

    stock_file = ema.save_dir("stock") / "checkpoint_last.pt"  # consolidate --ema reads stock's
    assert consolidate_main(["--ema", str(stock_file), str(tmp_path / "stock-ema.pt")]) == 0
    without = tmp_path / "without.pt"
    torch.save({"model": {}, "extra_state": {}}, without)
    with pytest.raises(CheckpointError, match="holds no EMA .* trained with --store-ema"):
        consolidate(str(without), str(tmp_path / "out.pt"), ema=True)


@pytest.mark.parametrize("ema_fp32, seed_from", [(False, "stock"), (True, "fsdp2")])
def test_fp16_ema_dtype_and_seed_model_as_fairseq(ema, ours, stock, ema_fp32, seed_from):
    """--fp16: fairseq's EMA averages its model's fp16 weights (the fp32 master rounded), kept
    in fp16, or in fp32 with --ema-fp32. --ema-seed-model: the EMA starts from another
    checkpoint's (a stock file, whose EMA lacks the final layer norms: those start from the
    model's weights; or the plugin's sharded checkpoint). Updates 1-2, decay 0.8 at each.
    The stock seed, full tensors, is cut into the shards of 2 ranks (EMA.restore); the sharded
    seed is read on 1 rank, one process fewer: DCP reshards the 2-rank save (EMA.load_shards,
    which --restore-file's EMA also goes through: at the same world size in
    test_ema_resumes_exactly_after_a_kill, resharded in test_ema_resharded_on_one_rank). The
    update is elementwise on each rank's part, the same on 1 rank or 2."""
    seed_file = ema.save_dir(seed_from) / "checkpoint_1_2.pt"
    label = f"fp16-{'fp32' if ema_fp32 else 'fp16'}"
    ema.run(label, "--fp16", "--max-update", 2, "--ema-start-update", 0, "--ema-update-freq", 1,
            "--ema-seed-model", seed_file, without=() if ema_fp32 else ("--ema-fp32",),
            ranks=2 if seed_from == "stock" else 1)
    runs = saves(ema.save_dir(label), 2)
    weights, first = runs[1]
    dtype = torch.float32 if ema_fp32 else torch.float16
    keys = [k for k in first if "version" not in k]
    assert {first[k].dtype for k in keys} == {dtype}
    seed = (stock if seed_from == "stock" else ours)[2][1]
    steps = fairseq_schedule(start=0, freq=1, updates=2)
    assert steps == {1: DECAY, 2: DECAY}
    # update 1: the EMA built (the seed, or the model's fp16 weights where the seed has none),
    # then fairseq's update
    start = {k: (seed[k] if k in seed else weights[k].half()).to(dtype) for k in keys}
    check_updates({0: (None, start), 1: runs[1]}, steps, keys, weights_dtype=torch.float16)
    check_updates(runs, steps, keys, weights_dtype=torch.float16)
