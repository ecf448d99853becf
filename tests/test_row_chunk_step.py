"""Adam stepped a chunk of rows at a time (optimizer/row_chunk_step.py) is the step of one chunk
per parameter, bit for bit, for float32, bf16 and 8-bit moments, with float32 gradients and
with 16-bit gradients whose pending factors the step applies; and with float32 moments it is
stock fairseq's Adam fed the float32 gradients those stand for.

Why bit for bit, in one process: Adam is element-wise, so a chunk of rows is stepped by the
same float32 operations on the same values (chunks of a multiple of 64 elements keep each
element in the same vector loop or scalar tail as one operation over the shard, OMP_NUM_THREADS
1 as the suite runs); the stochastic rounding draws from one CPU generator per parameter and
moment, rows in order, a fixed number of random bits per element, so the draws of consecutive
chunks are the whole tensor's. Shapes: rows of 300 (a chunk of 16 rows: 4800 elements, a last
block of 44 in each row), of 40 (several small parameters to a call), 130 x 7 (a chunk of 64
rows), a 1-D bias of 5000 and a tiny weight (float32 moments under 8 bits), an empty one.
"""
from __future__ import annotations

import pytest
import torch
from fairseq.optim.adam import FairseqAdamConfig
from omegaconf import OmegaConf

from fairseq_fsdp2.optimizer.build import build_optimizer

SHAPES = [(50, 300), (24, 40), (130, 7), (5000,), (8, 16), (0, 64)]
STEPS = 6
#: the chunked side's elements per call: 16 rows of 300, 64 rows of 7 (rows_per_chunk)
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
