"""Comparing the fairseq model with transformers' numerically (tests/test_hf_nllb.py,
tests/test_hf_add_langs.py): logits and greedy choices in float64, where neither CPU kernels nor
summation orders matter, with the tolerances derived below; and fairseq's generator on one
sentence (float32, as stock fairseq-generate runs it, or float64)."""
from __future__ import annotations

import contextlib
import copy

import torch

from numerics import U32

# HF against fairseq: logits and greedy choices are compared in float64 (both models converted
# with .double(); their float32 weights are exact in float64), where the two implementations'
# rounding lies far below what a wrong weight mapping does (a row, a transposition, a scale or
# bias lost: logits move by O(1)), on any CPU. "scale" is max(1, max |logit|).
# Each side's float64 logits are within A x U64 x scale of the exact ones, A being how far the
# forward amplifies its relative roundings (10 sublayers of sums reordered by the kernels, layer
# norms dividing by a standard deviation, softmax exponentiating: it depends on the weights, with
# no a-priori value). The same forward in float32 is within about A x U32 x scale: the guard in
# assert_logits_close requires each side's float32 logits within 2^-10 x scale of its float64
# ones (AMPLIFICATION_GUARD), so A <= 2^14 and the two float64 results are within
# 2 x 2^14 x 2^-53 = 2^-38 x scale of each other, 16x below LOGIT_TOL = 2^-34. (Seen on a Zen 5,
# AVX-512: float32 within 8e-7 (test_hf_nllb) and 1.2e-5 (test_hf_add_langs) of float64, A 14 and 200;
# float64 within 3e-15.) fairseq's float64 forward is made float64 throughout by
# fairseq_in_float64. Mutations tried: one weight element x (1 + 1e-5) on the HF side moves the
# logits by 5e-8 and 9e-9 x scale (the earlier float32 tolerance, 1e-4, let it pass).
LOGIT_TOL = 2.0 ** -34
AMPLIFICATION_GUARD = 2.0 ** -10
# Greedy choices: transformers' generate takes the argmax of the float64 logits rounded to
# float32 (generation/utils.py: next_token_logits .to(torch.float32)), each moved by up to
# U32 x scale; fairseq's (float64 log-probabilities, fairseq_in_float64) and HF's logits differ
# by up to LOGIT_TOL x scale. So the two can choose differently only where fairseq's best and
# second-best logits are within 2 x (LOGIT_TOL + U32) x scale: NEAR_TIE, in units of
# LOGIT_TOL x scale (greedy_gaps).
NEAR_TIE = 2 * (LOGIT_TOL + U32) / LOGIT_TOL


@contextlib.contextmanager
def fairseq_in_float64(model):
    """fairseq computes attention probabilities (cross-attention, and self-attention when
    decoding step by step) and the decoder's normalized output in float32 whatever the model's
    dtype (fairseq.utils.softmax / log_softmax pass dtype=torch.float32), which would round a
    float64 model's results to float32 precision. For a float64 ``model``, inside this they keep
    their input's dtype; a float32 model runs fairseq's code unchanged."""
    from fairseq import utils
    saved = utils.softmax, utils.log_softmax
    if next(model.parameters()).dtype == torch.float64:
        utils.softmax = lambda x, dim, onnx_trace=False: torch.softmax(x, dim)
        utils.log_softmax = lambda x, dim, onnx_trace=False: torch.log_softmax(x, dim)
    try:
        yield
    finally:
        utils.softmax, utils.log_softmax = saved


def fairseq_logits(model, request) -> torch.Tensor:
    """The model's logits (in the model's dtype) of the request's ``src`` / ``prev``."""
    src = torch.tensor(request["src"])
    with torch.no_grad(), fairseq_in_float64(model):
        return model(src, src.ne(1).sum(1), torch.tensor(request["prev"]))[0]


def assert_logits_close(model, model64, request, result) -> None:
    """fairseq's float64 logits (``model64``: ``model`` converted with .double()) equal HF's
    float64 ones within LOGIT_TOL x scale, after the guard on both sides' amplification of
    rounding (float32 within AMPLIFICATION_GUARD x scale of float64; see LOGIT_TOL)."""
    ours32, ours64 = fairseq_logits(model, request), fairseq_logits(model64, request)
    theirs32 = torch.tensor(result["logits"], dtype=torch.float64)
    theirs64 = torch.tensor(result["logits64"], dtype=torch.float64)
    assert ours64.dtype == torch.float64 and ours64.shape == theirs64.shape == ours32.shape
    scale = max(1.0, theirs64.abs().max().item())
    float32 = {}
    for side, x32, x64 in (("fairseq", ours32.double(), ours64), ("HF", theirs32, theirs64)):
        float32[side] = (x32 - x64).abs().max().item() / scale
        assert float32[side] <= AMPLIFICATION_GUARD, (side, float32[side])
    worst = (ours64 - theirs64).abs().max().item() / scale
    print(f"|float32 - float64| logits: {float32} x scale (guard {AMPLIFICATION_GUARD:.2e}); "
          f"|fairseq - HF| float64 logits: {worst:.2e} x scale (tolerance {LOGIT_TOL:.2e})")
    assert worst <= LOGIT_TOL, worst


def greedy_gaps(model64, src: list[int], tokens: list[int]) -> list[float]:
    """For each of fairseq's greedy ``tokens`` (language first), how far its choice was from a
    tie: the best minus the second-best float64 logit there, in units of LOGIT_TOL x scale
    (pad excluded: fairseq's generator never picks it)."""
    prev = [[2] + tokens[:-1]]  # fairseq's decoder starts from </s>
    logits = fairseq_logits(model64, {"src": [src], "prev": prev})[0]
    tol = LOGIT_TOL * max(1.0, logits.abs().max().item())
    logits[:, 1] = -torch.inf
    top = logits.topk(2, dim=-1).values
    return ((top[:, 0] - top[:, 1]) / tol).tolist()


def assert_same_greedy_choices(theirs: list, ours: list, gaps: list[float], sentence: int) -> None:
    """HF's and fairseq's float64 greedy decodings choose alike at every step, except at a
    near-tie (gap <= NEAR_TIE): there rounding alone can flip the choice, and after it the two
    continue from different contexts. So the sequences are equal, or they first differ at such
    a near-tie, and nothing after it is compared. (A near-tie is a gap below about 2^-23 of the
    logits' scale: the rule is there for soundness, not because one was seen.)"""
    k = next((k for k, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
    if k is None and len(theirs) != len(ours):
        k = min(len(theirs), len(ours))
    assert k is None or gaps[k] <= NEAR_TIE, (sentence, k, theirs, ours, gaps)


def hypothesis(task, generator, model, src: list[int]) -> dict:
    """fairseq's best hypothesis for one sentence (its ``tokens``: language, words, </s>; its
    ``score``)."""
    sample = {"net_input": {"src_tokens": torch.tensor([src]),
                            "src_lengths": torch.tensor([len(src)])}}
    with fairseq_in_float64(model):
        return task.inference_step(generator, [model], sample)[0][0]


def greedy(task, generator, model, src: list[int]) -> list[int]:
    return hypothesis(task, generator, model, src)["tokens"].tolist()


def as_float64(model):
    return copy.deepcopy(model).double()
