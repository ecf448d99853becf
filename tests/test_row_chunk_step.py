"""Adam stepped a chunk of rows at a time (optimizer/row_chunk_step.py) is the step of one chunk
per parameter, bit for bit, for float32, bf16 and 8-bit moments, with float32 gradients and
with 16-bit gradients whose pending factors the step applies; and with float32 moments it is
stock fairseq's Adam fed the float32 gradients those stand for. At a production size (millions
of elements, the production chunk, several threads), bf16 and 8-bit moments against a
reference written out independently (the last test).

Why bit for bit, in one process: Adam is element-wise, so a chunk of rows is stepped by the
same float32 operations on the same values; the stochastic rounding draws from one CPU
generator per parameter and moment, rows in order, a fixed number of random bits per element,
so the draws of consecutive chunks are the whole tensor's (bf16 takes 4 elements' draws from
each 64-bit draw: a chunk of a multiple of 64 elements, rows_per_chunk's, wastes none). Shapes:
rows of 300 (a chunk of 16 rows: 4800 elements, a last block of 44 in each row), of 40
(several small parameters to a call), 700 x 7 (chunks of 640 rows and a last of 60: 4800
elements hold 685 rows of 7, 4795 elements, not a multiple of 4), a 1-D bias of 5000 and a tiny
weight (float32 moments under 8 bits), an empty one.
"""
from __future__ import annotations

import pytest
import torch
from fairseq.optim.adam import Adam as FairseqAdam
from fairseq.optim.adam import FairseqAdamConfig
from omegaconf import OmegaConf

from fairseq_fsdp2.optimizer.moments.blockwise_8bit import BLOCK, dynamic_map
from fairseq_fsdp2.optimizer.build import build_optimizer
from fairseq_fsdp2.optimizer.moments.eight_bit import ABSMAX_KEYS
from fairseq_fsdp2.optimizer.moments.format import MOMENTS
from fairseq_fsdp2.optimizer.row_chunk_step import STEP_CHUNK, rows_per_chunk, stream_seed
from fairseq_fsdp2.optimizer.moments.stochastic_round import generator_for

SHAPES = [(50, 300), (24, 40), (700, 7), (5000,), (8, 16), (0, 64)]
STEPS = 6
#: the chunked side's elements per call: 16 rows of 300, 640 rows of 7 (rows_per_chunk)
SMALL = 4800


def adam(params, stats: str):
    cfg = OmegaConf.create({
        "common": {"fp16": False, "seed": 1}, "optimization": {"update_freq": [1]},
        "distributed_training": {"bf16_adam_stats": stats == "bf16",
                                 "eight_bit_adam_stats": stats == "8bit"},
        "optimizer": OmegaConf.structured(FairseqAdamConfig(
            _name="adam", lr=[1e-2], adam_betas=(0.9, 0.999), weight_decay=0.01, tpu=False))})
    return build_optimizer(cfg, params)


def grads_for(step: int):
    g = torch.Generator().manual_seed(step)
    # magnitudes over 4 decades along the rows, as in tests/test_adam_stats_8bit.py
    return [torch.randn(s, generator=g) * torch.logspace(-4, 0, s[-1]) for s in SHAPES]


def params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def run(stats: str, chunk: int, grad_dtype=None, factors=(0.5, 0.3)):
    """STEPS steps; each gradient given in ``grad_dtype`` (None: float32) and scaled by the
    factors through fairseq's multiply_grads (left pending for 16-bit gradients)."""
    ps = params()
    opt = adam(ps, stats)
    opt.optimizer.step_chunk = chunk
    for t in range(STEPS):
        for p, g in zip(ps, grads_for(t)):
            if grad_dtype is not None:
                p.grad_dtype = None
                g = g.to(grad_dtype)
            p.grad = g
        for c in factors:
            opt.multiply_grads(c)
        opt.step()
        opt.zero_grad()
    return ps, opt.optimizer.state


def assert_identical(a, b):
    (pa, sa), (pb, sb) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    for x, y in zip(pa, pb):
        ka, kb = sa[x], sb[y]
        assert ka.keys() == kb.keys()
        for k in ka:
            assert torch.equal(torch.as_tensor(ka[k]), torch.as_tensor(kb[k])), k


@pytest.mark.parametrize("stats", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("grad_dtype", [None, torch.bfloat16, torch.float16])
def test_row_chunks_step_as_one_chunk_per_parameter(stats, grad_dtype):
    if stats == "fp32" and grad_dtype is None:
        pytest.skip("float32 moments and gradients: fairseq's own step (below)")
    chunked = run(stats, SMALL, grad_dtype)
    whole = run(stats, 1 << 40, grad_dtype)
    assert_identical(chunked, whole)
    if stats == "8bit":
        assert chunked[1][chunked[0][0]]["exp_avg"].dtype == torch.uint8  # 8 bits were stored


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_gradients_step_as_their_float32_values_in_fairseqs_adam(grad_dtype):
    """float32 moments: the chunked step with 16-bit gradients and pending factors against
    fairseq's own Adam fed the 16-bit values widened and scaled in place (what FSDP2's fp32
    shard and fairseq's multiply_grads give). The same arithmetic: bit for bit."""
    chunked = run("fp32", SMALL, grad_dtype)
    ps = params()
    opt = adam(ps, "fp32")
    for t in range(STEPS):
        for p, g in zip(ps, grads_for(t)):
            p.grad = g.to(grad_dtype).float()
        for c in (0.5, 0.3):
            opt.multiply_grads(c)
        opt.step()
        opt.zero_grad()
    assert_identical(chunked, (ps, opt.optimizer.state))
    # not vacuous: the 16-bit gradients are not the float32 ones
    assert not torch.equal(run("fp32", SMALL, None)[0][0], ps[0])


# -- a production size, several threads, against an independent reference ---------------------

#: rows of 1001 elements (neither a multiple of 64 nor of 4): the production STEP_CHUNK (2^22
#: elements) holds 4190 rows, which rows_per_chunk cuts to 4160 (a multiple of 64 rows, so of
#: 64 elements); 4200 rows step as chunks of 4160 and 40 rows
BIG = (4200, 1001)
#: the first stores without reading a stored moment, the second reads what the first stored
BIG_STEPS = 2
#: the threads the step and the reference run with (the suite's processes run one): ATen
#: splits each operation over 4,204,200 or 4,164,160 elements between them at other, unaligned
#: places
THREADS = 2


def reference_round(x: torch.Tensor, stats: str, signed: bool, generator: torch.Generator):
    """The stored form of the float32 moment ``x`` (one parameter's rows), written out from the
    formats' definitions, not with the plugin's functions. The draws: one generator's, over
    the whole tensor at once (64-bit draws, each four 16-bit ones, low bits first), an
    element's 16-bit draw d at its place (8 bits: its place in its row's blocks of BLOCK, the
    last one padded). bf16: d added to the float32 bit pattern, whose low 16 bits are then
    cleared (rounded up with probability low bits / 2^16). 8 bits (codes, block maxima), each
    block of a row: s = x / max|x| in float32; its lower map neighbour the largest map value
    <= s (index 0..254; a positive s below the unsigned map's least positive value: that
    value, index 1); up x 2^16 = (s - lower) / (upper - lower) x 2^16 in float32 (x 2^16 is
    exact); the upper neighbour where d < up x 2^16."""
    if stats == "bf16":
        draws = torch.empty(-(-x.numel() // 4), dtype=torch.int64).random_(
            -1 << 63, None, generator=generator)
        d = draws.view(torch.int16)[:x.numel()].int() & 0xFFFF
        bits = (x.reshape(-1).view(torch.int32) + d) & -(1 << 16)
        return bits.view(torch.float32).view(x.shape).to(torch.bfloat16)
    rows, row = x.shape
    blocks = -(-row // BLOCK)
    padded = torch.zeros(rows, blocks * BLOCK)
    padded[:, :row] = x
    draws = torch.empty(padded.numel() // 4, dtype=torch.int64).random_(
        -1 << 63, None, generator=generator)
    d = draws.view(torch.uint16).view(padded.shape)[:, :row].float()
    absmax = padded.view(rows, blocks, BLOCK).abs().amax(-1)
    s = x / absmax.repeat_interleave(BLOCK, 1)[:, :row]
    q = dynamic_map(signed)
    low = torch.searchsorted(q, s, right=True, out_int32=True).sub_(1).clamp_(0, 254)
    if not signed:
        low = torch.where((low == 0) & (s > 0), 1, low)
    lower = torch.index_select(q, 0, low.view(-1)).view(s.shape)
    gap = torch.index_select(q, 0, low.view(-1) + 1).view(s.shape) - lower
    return (low + (d < (s - lower) / gap * 65536.0)).to(torch.uint8), absmax


def reference_widen(stored, stats: str, signed: bool) -> torch.Tensor:
    """The float32 moment a stored one stands for: bf16 widened (exact); 8 bits: each code's
    map value times its block's maximum (one float32 product)."""
    if stats == "bf16":
        return stored.float()
    codes, absmax = stored
    return dynamic_map(signed)[codes.long()] * \
        absmax.repeat_interleave(BLOCK, 1)[:, :codes.shape[1]]


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bit for bit (dtype, shape, values); else how many elements differ, the first where."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    differ = (got != want).nonzero()
    assert not len(differ), f"{what}: {len(differ)} of {got.numel()} elements differ, the " \
                            f"first at {differ[0].tolist()} ({got.shape[1]} to a row)"


@pytest.mark.parametrize("stats", ["bf16", "8bit"])
def test_a_production_size_steps_as_an_independent_reference(stats):
    """A parameter of 4.2M elements (rows of 1001) stepped at the production STEP_CHUNK
    (chunks of 4160 and 40 rows) by THREADS threads, BIG_STEPS steps, against a reference made
    of fairseq's own Adam over the whole tensor (float32 moments: the reference's own stored
    ones, widened) and the formats' rounding written out (``reference_round``), drawing from
    the stream the optimizer seeds for the parameter's moment (stream_seed; that streams
    differ: tests/test_adam_stats.py): the parameter and the stored moments equal bit for bit
    after every step. Why bit for bit: the step's operations are elementwise and compute the
    same float32 value in their vectorized loop as in their scalar tail (so wherever a
    thread's or a chunk's range begins), and the draws of consecutive chunks are the whole
    tensor's (8 bits: each row draws its padded blocks' elements; bf16: a chunk holds a
    multiple of 4 elements, the 16-bit draws of one 64-bit draw; here 4,164,160, where 4190
    rows would hold 4,194,190)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        g = torch.Generator().manual_seed(7)
        start = torch.randn(BIG, generator=g)
        p, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
        opt = adam([p], stats).optimizer
        assert opt.step_chunk == STEP_CHUNK and rows_per_chunk(BIG[1], STEP_CHUNK) < BIG[0]
        ref_opt = FairseqAdam([ref], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
        stored = None
        for t in range(1, BIG_STEPS + 1):
            grad = torch.randn(BIG, generator=g) * torch.logspace(-4, 0, BIG[1])
            p.grad, ref.grad = grad.clone(), grad.clone()
            opt.step()
            if stored is not None:
                ref_opt.state[ref] = {"step": t - 1, **{
                    key: reference_widen(stored[k], stats, k == 0)
                    for k, key in enumerate(MOMENTS)}}
            ref_opt.step()
            # the parameter's place 1 (of 1), its moment k, the run's seed 1, step t
            stored = [reference_round(ref_opt.state[ref][key], stats, k == 0, generator_for(
                torch.device("cpu"), stream_seed(1, t, 1, k))) for k, key in enumerate(MOMENTS)]
            assert_same(p.detach(), ref.detach(), f"step {t}: the parameter")
            state = opt.state[p]
            for k, key in enumerate(MOMENTS):
                if stats == "bf16":
                    assert_same(state[key], stored[k], f"step {t}: {key}")
                else:
                    assert_same(state[ABSMAX_KEYS[key]], stored[k][1], f"step {t}: {key} maxima")
                    assert_same(state[key], stored[k][0], f"step {t}: {key} codes")
    finally:
        torch.set_num_threads(threads)
