"""Adam's moments in 8 bits between steps (``--eight-bit-adam-stats``: optimizer/adam_stats.py,
the format in optimizer/moments/blockwise_8bit.py).

In one process: the plugin's Adam and a float32 Adam fed the same gradients, every element of
both moments and of the parameter within a bound derived from the block-wise quantization after
every step (below); the second moment decays as in float32 where rounding to nearest would
keep it; the map is bitsandbytes' dynamic map. Then fairseq-train runs: training against
float32 moments (one rank, and two with uneven shards), exact resume, the export. Elsewhere:
the 2 -> 3 rank reshard and conversions (tests/test_adam_stats.py), the local-shard step
against DTensor dispatch (tests/test_local_shards.py), the estimate
(tests/test_estimate_rules.py).

The bound. A block of the float32 moment y (BLOCK elements of a row) is stored as codes c and
A = max|y| (exact: a maximum rounds nothing). Each element: x = fl(y / A), |x - y / A| <= U32
|y| / A; the code is one of x's two neighbours in the map (below the signed map's least value
-0.993: that value), so |q[c] - x| <= G, the map's largest gap (0.9 / 64 signed, 0.9 / 128
unsigned: gap_of) or 1 + q[0]; then fl(q[c] x A) rounds once more: |stored - y| <= (G + 2 U32) A
(|q[c]| <= 1, |y| <= A). Between stores both runs compute beta x stored + (1 - beta) x term in
float32 from values that differ by the previous bound (at most 4 roundings: as for 16 bits,
tests/test_adam_stats.py). The step uses the moments before they are stored (the float32 values
of this step): with |m' - m| <= Bm and |v' - v| <= Bv, fairseq's update lr' m / (sqrt(v) + eps)
(lr' = lr sqrt(1 - b2^t) / (1 - b1^t)) differs by at most lr' (Bm / (sqrt(v') + eps) + |m|
Bv / ((sqrt(v') + sqrt(v)) (sqrt(v') + eps) (sqrt(v) + eps))), since |sqrt(v') - sqrt(v)| =
|v' - v| / (sqrt(v') + sqrt(v)); plus each run's float32 rounding of the update (sqrt, add,
divide, multiply, subtract: 6 U32 of |update| each, and of |p| for the subtraction).

Unlike 16-bit moments (moment_rounding_step_error), the error is relative to the block's largest
element, not to the element: an element 10^-3 of its block's largest carries an error of up to
G / 10^-3 of itself, so no bound relative to the element (or to lr) holds for every element;
the bound here is computed from the values, element by element.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from conftest import other_rounding_draws, train_args_for
from launcher import ok, run_command, run_ranks
from moment_bounds import (assert_8_bit_second_moment_decays, assert_8_bit_steps_within_bound,
                           gap_of)
from numerics import U32, assert_within_noise, per_update
from scenarios import FSDP2, is_adam_moment, shard_tensors

from fairseq_fsdp2.optimizer.moments.blockwise_8bit import (BLOCK, dequantize, dynamic_map,
                                                            quantize)


def test_the_maps_are_bitsandbytes_dynamic_maps():
    """256 distinct ascending values on [-1, 1] / [0, 1] with 0 and 1 exact; 7 decades of
    midpoints of even splits of [0.1, 1] (2^i, unsigned 2^(i+1) points in decade i): the
    largest gaps 0.9 / 64 and 0.9 / 128 (in the top decade) up to float32 rounding of the
    values; the unsigned map's smallest positive value 10^-6 x 0.325."""
    for signed, top_points in ((True, 64), (False, 128)):
        q = dynamic_map(signed).double()
        assert q.numel() == 256 and (q.diff() > 0).all() and 0.0 in q.tolist() and q[-1] == 1
        least = -(1 - 0.9 / top_points / 2) if signed else 0.0  # the top decade's last midpoint
        assert abs(q[0].item() - least) <= 2 * U32
        assert abs(q.diff().max().item() - 0.9 / top_points) <= 4 * U32
    assert abs(dynamic_map(False)[1].item() - 0.325e-6) <= 0.325e-6 * 2 * U32


def test_quantize_round_trip_within_the_gap_and_unbiased():
    """One store: every element within (G + 2 U32) x its block's absmax; the absmax are the
    blocks' maxima (rows of 300: blocks of 256 and 44); each block's largest element, where
    positive, is stored exactly; a positive second moment is never stored as 0. Stochastic
    rounding is unbiased (within the map's range): the mean of n = 1000 independent stores of
    one value, each in an interval of width at most G x A around it, lies within
    4 G A / sqrt(n) of it except with probability 2 exp(-2 x 16) = 2.5e-14 per element
    (Hoeffding; 1.5e-11 over 600 elements; a fixed seed all the same)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300) * torch.logspace(-7, 0, 300)
    for signed, y in ((True, x), (False, x.square())):
        codes, absmax = quantize(y, signed, g)
        assert codes.dtype == torch.uint8 and codes.shape == y.shape
        padded = torch.nn.functional.pad(y.abs(), (0, 2 * BLOCK - 300))
        assert torch.equal(absmax, padded.view(5, 2, BLOCK).amax(-1))
        back = dequantize(codes, absmax, signed)
        a = absmax.repeat_interleave(BLOCK, 1)[:, :300]
        assert ((back - y).abs() <= (gap_of(signed) + 2 * U32) * a).all()
        top = y == a  # a positive largest: code 255 is 1 exactly (the signed map's least
        assert top.any() and torch.equal(back[top], y[top])  # is -0.993, not -1)
        if not signed:
            assert (back[y > 0] > 0).all()
    # a rank's empty shard (more ranks than rows) and a 3-D parameter (rows of 4 x 100)
    codes, absmax = quantize(torch.zeros(0, 300), True, g)
    assert codes.shape == (0, 300) and absmax.shape == (0, 2)
    z = torch.randn(3, 4, 100)
    codes, absmax = quantize(z, True, g)
    assert absmax.shape == (3, 2) and torch.equal(absmax[:, 0], z.reshape(3, 400)[:, :BLOCK]
                                                  .abs().amax(1))
    y = torch.randn(2, 300)
    runs = torch.stack([dequantize(*quantize(y, True, g), True) for _ in range(1000)])
    a = torch.nn.functional.pad(y.abs(), (0, 2 * BLOCK - 300)).view(2, 2, BLOCK).amax(-1)
    a = a.repeat_interleave(BLOCK, 1)[:, :300]
    inside = y >= dynamic_map(True)[0] * a  # a negative largest (-A) is stored as -0.993 A
    assert ((runs.mean(0) - y).abs()[inside] <= 4 * gap_of(True) / math.sqrt(1000) *
            a[inside]).all()


def test_8_bit_moments_and_steps_stay_within_their_quantization_of_float32():
    """30 steps of gradients whose magnitudes span 1e-4..1 along each row (blocks of 256 and a
    last one of 44 per row; moments over 8 decades), against a float32 Adam fed the same
    gradients: after every step each moment element within the bound of the module docstring,
    and each parameter element within the sum of the steps' bounds (a 3-D parameter's rows of
    4 x 400). A 1-D parameter and one of fewer than 4096 elements keep float32 moments, equal
    to the float32 run's bit for bit (moment_bounds.py; tests/test_cuda_step.py runs the same
    comparison on a GPU)."""
    assert_8_bit_steps_within_bound(torch.device("cpu"), {
        "big": (24, 300), "three_d": (3, 4, 400), "small": (8, 16), "bias": (5000,)})


def test_8_bit_second_moment_decays_as_in_float32():
    """Why stochastic rounding (blockwise_8bit.py): a 32 x 4096 parameter whose blocks' first
    elements get gradient 1 at every step (each block's largest v, 1 - 0.999^t), the others
    +-1 for 50 steps and then 0 for 250, against a float32 Adam fed the same gradients. There
    the decaying elements' v moves by 0.1% of itself per step, and the block's largest grows
    by less than 1% per step from step 100 on: below half the unsigned map's relative gap near them (about 0.0035 / x,
    x = v / absmax = 0.15 .. 1: 0.35% .. 2.4%), so rounded to nearest (the control) v keeps
    its code, and stays far above. The plugin's codes, rounded stochastically, are unbiased:
    each store's error has mean zero given the past and magnitude at most G x A (A <= 0.26, the
    block's absmax at step 300; G = 0.9 / 128), and reaches v_T multiplied by b2^(T-t) <= 1.
    So the mean of v over the N = 32 x 4080 decaying elements is off from float32's by a sum
    of N x T martingale increments of at most G A / N each: by Azuma-Hoeffding it exceeds eps
    with probability at most 2 exp(-eps^2 N / (2 T G^2 A^2)): for eps = 5e-4 (1.3% of the
    exact v, 0.038), N = 130560, T = 300: 2 e^-16 (the seed is fixed: deterministic all the
    same). The float32 arithmetic of both runs differs by far less (300 x 8 x U32 of v).
    tests/test_cuda_step.py runs the same on a GPU (its rounding draws from another generator:
    the argument holds for any whose draws are uniform and independent of the values)."""
    assert_8_bit_second_moment_decays(torch.device("cpu"))  # moment_bounds.py


# -- fairseq-train ------------------------------------------------------------------------------

# FSDP2 (tests/scenarios.py) reads the batches in the rank's process: with a data-loader worker,
# rank 0's export at the end of a saved run here stalled 5 s (NO_WORKER's note; 3 saved runs:
# 15 s idle)
#: the tiny model (conftest.TINY_MODEL) at width 64: its attention projections (64 x 64), FFN
#: (128 x 64) and embedding (88 x 64) reach 8 bits' 4096 elements; biases and norms stay float32
WIDER = ["--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
         "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128"]
#: the two-rank runs' model: WIDER with FFN weights of 127 x 64 and 64 x 127 (encoder), 129 x 64
#: and 64 x 129 (decoder): uneven shards on two ranks (64 + 63, 65 + 64 rows), rows of one
#: short block
UNEVEN = ["--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
          "--encoder-ffn-embed-dim", "127", "--decoder-ffn-embed-dim", "129"]
MODEL = {1: WIDER, 2: UNEVEN}
#: the one-rank comparison's length: every systematic error of the format tried by hand (a code
#: read as its neighbour, block maxima stored 10% too large, a row read with another row's
#: maxima) left float32 moments by 20 times the twin's spread or more within updates 3-50 (the
#: closing note of issue 46); 200 updates cost 3.3 times as much and found nothing the first 50
#: did not. Tried again in dequantize (2026-12-06), each fails at its first update beyond the
#: noise: maxima 10% too large and the previous row's maxima at update 3, the neighbour's code
#: at update 10 (its loss off by 5.8 times the spread there, by 6.5 to 9.5 times at every
#: update of 11-20). Update n is held to the spread over updates n - 10 .. n + 10
#: (numerics.NOISE_REACH), so up to update 10 a 20-update run checks each update exactly as a
#: 50-update one does (the runs are prefixes of each other: a constant lr), hence 20 (it was 50,
#: 60, 200). Loss at update 20: 5.78, below a uniform prediction's 6.46 (7.96 at update 1).
#: Unbiased rounding over long runs is test_8_bit_second_moment_decays_as_in_float32's claim
#: (300 steps, no training run).
UPDATES = 20
EIGHT_BIT = ["--eight-bit-adam-stats"]
#: the two-rank 8-bit run: saved at update 10 (resumed below) and at its end (update 12); no
#: export at its end (nothing reads one: test_consolidate_exports_weights_without_the_8_bit_state
#: runs the command on checkpoint_last.pt)
SAVED = [*EIGHT_BIT, "--save-interval-updates", "10", "--fsdp2-no-consolidate"]
SAVED_UPDATES = 12


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """Runs of the wider tiny model (MODEL: WIDER on one rank, UNEVEN on two): flags -> (rank
    0's output, save dir), each once. The long comparison with float32 moments trains UPDATES
    updates on one rank (a rank's gloo collectives would double its cost); the 8-bit state's
    save and resume, and a short comparison where the 8-bit code meets shards, on two ranks
    (each shard draws its own stochastic rounding), 12 updates. ``other_draws``: the run
    through tests/probes/other_rounding_draws.py (the same run, other random numbers for the
    rounding)."""
    done = {}

    def run(*flags, ranks=1, updates=UPDATES, other_draws=False):
        key = (flags, ranks, updates, other_draws)
        if key not in done:
            save_dir = tmp_path_factory.mktemp("run")
            probe = other_rounding_draws() if other_draws else {}
            done[key] = (ok(run_ranks(ranks, lambda r: train_args_for(
                corpus, save_dir, *FSDP2, *MODEL[ranks], *flags, updates=updates,
                save="--save-interval-updates" in flags), timeout=600, **probe)), save_dir)
        return done[key]
    return run


def test_eight_bit_adam_stats_train_within_their_rounding_of_float32_moments(trained):
    """--eight-bit-adam-stats against the same run with float32 moments, UPDATES updates: update 1
    and 2 equal bit for bit (the first step reads no stored moment); from update 3 on, loss and
    gnorm within the noise of the rounding itself, measured in the same test: the spread
    between the 8-bit run and the same run with other rounding draws, update by update around
    each (numerics.assert_within_noise says why that and not a bound: none relative to an
    element exists, the module docstring). A systematic error of the format (a wrong block
    maximum, a moment read with another block's maximum, a code read as its neighbour) moves
    both 8-bit runs alike away from float32 moments, by 20 times their spread or more in the
    first 50 updates (tried by hand; the closing note of issue 46), beyond 5 times it by update
    10 (UPDATES says why 20 suffice). And the runs do differ, and it trained (from above to
    below a uniform prediction's loss)."""
    ours, _ = trained(*EIGHT_BIT)
    reference, twin = trained()[0], trained(*EIGHT_BIT, other_draws=True)[0]
    assert_trains_within_noise(ours, reference, twin, UPDATES)
    got, want = per_update(ours), per_update(reference)
    assert per_update(twin) != got  # the twin drew other numbers
    assert got != want
    # it trained: below what predicting every word alike scores, log2 of the dictionary's size
    # (with label smoothing too: a uniform prediction's smoothed loss is its nll, log2 V)
    words = int(re.search(r"\[src\] dictionary: (\d+) types", ours).group(1))
    assert float(got[UPDATES][0]) < math.log2(words) < float(got[1][0]), (got[UPDATES], words)


def assert_trains_within_noise(ours: str, reference: str, twin: str, updates: int) -> None:
    """Updates 1..updates of all three runs, the 8-bit ones with 8-bit moments; 1 and 2 equal
    bit for bit, 3.. within the noise (numerics.assert_within_noise)."""
    for out in (ours, twin):
        assert "Adam's moments kept in 8bit between steps (--eight-bit-adam-stats)" in out
    got, want = per_update(ours), per_update(reference)
    assert sorted(got) == sorted(want) == sorted(per_update(twin)) == \
        list(range(1, updates + 1))
    assert got[1] == want[1] and got[2] == want[2], (got[1], want[1], got[2], want[2])
    assert_within_noise(ours, reference, twin, range(3, updates + 1))


def test_two_ranks_train_within_their_rounding_of_float32_moments(trained, tmp_path):
    """The same comparison on two ranks, where the 8-bit code meets sharded parameters: uneven
    shards (UNEVEN's FFN weights of 127 and 129 rows: 64 + 63 and 65 + 64 rows a rank, their
    block maxima sharded alike: rows_like), each shard rounding from its own stream (the
    shard's place in the seed), the state as DTensors. The run the resume test saves (12
    updates), against the same two ranks with float32 moments and with other rounding draws.
    So few updates print alike to fairseq's 3 decimals, or nearly: the tolerance is then the
    printed rounding's, and a systematic error on one rank's shards shows (tried by hand: rank
    1's block maxima stored 10% too large, 0.013 off the loss by update 8, at most 0.001 between
    the 8-bit runs). That the twin drew other numbers: its last moments' codes are not ours."""
    ours, save_dir = trained(*SAVED, ranks=2, updates=SAVED_UPDATES)
    reference = trained(ranks=2, updates=SAVED_UPDATES)[0]
    twin, twin_dir = trained(*SAVED, ranks=2, updates=SAVED_UPDATES, other_draws=True)
    assert_trains_within_noise(ours, reference, twin, SAVED_UPDATES)
    mine = shard_tensors(save_dir / "checkpoint_last.pt", tmp_path / "ours.pt")
    theirs = shard_tensors(twin_dir / "checkpoint_last.pt", tmp_path / "twin.pt")
    codes = [k for k, v in mine.items() if k.startswith("optim.state.") and v.dtype == torch.uint8]
    assert codes and all(not torch.equal(mine[k], theirs[k]) for k in codes)


def test_eight_bit_adam_stats_are_saved_in_8_bits_and_resume_exactly(trained, corpus, tmp_path):
    """Two ranks: the checkpoint of update 10 holds the weights' moments as uint8 codes shaped
    like the weights with float32 block maxima (rows x blocks), the biases' and norms' in
    float32 (DCP metadata); resumed from it, updates 11-12 equal the uninterrupted run's, bit
    for bit, and so does every tensor of the last checkpoint (weights, codes, block maxima,
    float32 moments): the codes of steps 11 and 12 were rounded with the uninterrupted run's
    draws (the stochastic rounding draws from the seed, the step and the parameter's, the
    moment's and the shard's place). The printed values alone could not show those draws:
    update 12's loss is computed before step 12 reads what step 11 stored."""
    import torch.distributed.checkpoint as dcp

    from fairseq_fsdp2.checkpoint.sharded import SHARDS_DIR
    out, save_dir = trained(*SAVED, ranks=2, updates=SAVED_UPDATES)
    full = per_update(out)
    (checkpoint,) = save_dir.glob("checkpoint_*_10.pt")
    shards = torch.load(checkpoint, weights_only=True)["fsdp2"]["shards"]
    assert shards.startswith(SHARDS_DIR)
    saved = dcp.FileSystemReader(str(save_dir / shards)).read_metadata().state_dict_metadata
    codes = {k: v for k, v in saved.items()
             if is_adam_moment(k) and v.properties.dtype == torch.uint8}
    wide = [k for k, v in saved.items()
            if is_adam_moment(k) and v.properties.dtype == torch.float32]
    assert codes and wide and all(".bias." in k or "layer_norm" in k for k in wide), wide
    for key, meta in codes.items():
        absmax = saved[key + "_absmax"]
        rows, row = meta.size[0], math.prod(meta.size[1:])
        assert absmax.properties.dtype == torch.float32
        assert tuple(absmax.size) == (rows, -(-row // BLOCK)), (key, absmax.size)
    resumed_dir = tmp_path / "resumed"
    resumed = per_update(ok(run_ranks(2, lambda r: train_args_for(
        corpus, resumed_dir, *FSDP2, *UNEVEN, *EIGHT_BIT, "--restore-file", checkpoint,
        "--fsdp2-no-consolidate", updates=SAVED_UPDATES, save=True))))
    assert resumed == {n: full[n] for n in (11, 12)}, (resumed, full)
    got = shard_tensors(resumed_dir / "checkpoint_last.pt", tmp_path / "resumed.pt")
    want = shard_tensors(save_dir / "checkpoint_last.pt", tmp_path / "uninterrupted.pt")
    assert got.keys() == want.keys() and set(codes) <= set(got), sorted(set(got) ^ set(want))
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"the resumed run's last state differs in {len(differ)} of " \
                       f"{len(want)} tensors, e.g. {differ[:3]}"


def test_consolidate_exports_weights_without_the_8_bit_state(trained, tmp_path):
    """python -m fairseq_fsdp2.consolidate on the two-rank 8-bit run's last checkpoint: a stock
    checkpoint of float32 weights, the model's parameters (no codes, no block maxima) and no
    optimizer state, as for a float32-moment run."""
    out, save_dir = trained(*SAVED, ranks=2, updates=SAVED_UPDATES)
    exported = tmp_path / "model.pt"
    proc = run_command("fairseq_fsdp2.consolidate", save_dir / "checkpoint_last.pt", exported)
    assert proc.returncode == 0, proc.output[-2000:]
    state = torch.load(exported, weights_only=True)
    assert "last_optimizer_state" not in state and "fsdp2" not in state
    model = state["model"]
    assert model and all(t.dtype == torch.float32 for t in model.values())
    assert not any("absmax" in k or "exp_avg" in k for k in model)
    assert "encoder.layers.0.self_attn.k_proj.weight" in model
    assert model["encoder.layers.0.self_attn.k_proj.weight"].shape == (64, 64)
