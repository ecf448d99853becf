"""``python -m fairseq_fsdp2.estimate ... --fit-gb G``: the largest --max-tokens predicted to fit
G GiB per rank (estimator/fit.py), on the meta device (nothing allocated)."""
from __future__ import annotations

import functools

import pytest

from test_estimate_rules import GIB, nllb_args

from fairseq_fsdp2 import estimate as cli
from fairseq_fsdp2.estimator import from_args
from fairseq_fsdp2.estimator.fit import MAX_STEPS, largest_max_tokens
from fairseq_fsdp2.estimator.peak import estimate

ARGS = nllb_args("transformer_nllb_tiny", "--fp16", "--seq-len", "64")
STEP = 64 * 8  # --seq-len x --required-batch-size-multiple (8, fairseq's default)


@pytest.fixture(scope="module")
def models():
    """The model and its profiles, made once for the module's searches (from_args.ModelCache,
    as the estimate command shares them between its estimate and its search)."""
    return from_args.ModelCache()


@functools.cache  # deterministic: each made once, anew (no ModelCache), for the module
def predicted(max_tokens: int, world: int = 2) -> float:
    args = from_args.parse(ARGS)
    args.max_tokens = max_tokens
    return estimate(from_args.profile_for(args), from_args.setup_for(args, world)).peak_gb


def test_the_largest_max_tokens_fits_and_one_batch_more_does_not(models):
    """A budget between the predictions at 3 and 4 batches of 8 sentences gives 3 batches' tokens
    (the search's bisection lands on the boundary, whatever it probes first); below one batch:
    none; above the largest tried: that, said to be capped."""
    three, four = predicted(3 * STEP), predicted(4 * STEP)
    assert three < four  # the logits and activations grow with the batch
    args = from_args.parse(ARGS)
    (fit,) = largest_max_tokens(args, (three + four) / 2, [2], models=models)
    assert (fit.max_tokens, fit.peak_gb, fit.capped) == (3 * STEP, three, False)
    assert "is 1536, predicted" in fit.line()
    assert largest_max_tokens(args, predicted(STEP) - 1 / GIB, [2],
                              models=models)[0].max_tokens is None
    (top,) = largest_max_tokens(args, 1e6, [2], models=models)
    assert top.max_tokens == MAX_STEPS * STEP and top.capped and "more may fit" in top.line()


def test_a_claimed_largest_max_tokens_is_taken_only_where_it_holds(models):
    """The documented tables' check (doc_tables.render with the cells the docs hold): a claim
    is the search's answer when it fits and one batch more does not; one batch too few or too
    many, or "none" where a batch fits, is not taken, and the search's answer comes back."""
    three, four = predicted(3 * STEP), predicted(4 * STEP)
    args = from_args.parse(ARGS)
    budget = (three + four) / 2
    (searched,) = largest_max_tokens(args, budget, [2], models=models)
    assert searched.max_tokens == 3 * STEP
    for claim in (2 * STEP, 4 * STEP, None):  # the right one: test_predicted_tables
        assert largest_max_tokens(args, budget, [2], {2: claim}, models) == [searched], claim
    (none,) = largest_max_tokens(args, predicted(STEP) - 1 / GIB, [2], {2: None}, models)
    assert none.max_tokens is None


def test_cli_prints_the_fit_and_refuses_a_budget_that_is_no_memory(capsys):
    assert cli.main(ARGS + ["--world-size", "2", "--fit-gb", "1000"]) == 0
    assert "2 rank(s): the largest --max-tokens that fits 1000 GiB per rank is" in \
        capsys.readouterr().out
    assert cli.main(ARGS + ["--fit-gb", "-1"]) == 2
    assert capsys.readouterr().err.startswith("fairseq_fsdp2.estimate: error: --fit-gb -1: give ")


def test_a_model_cache_shares_a_model_only_between_arguments_that_build_the_same():
    """from_args.ModelCache (the estimate command's, the doc tables'): one model for arguments
    that differ only in the batch, the ranks, the device or the budget, and the same model
    after its build named the synthetic dictionary's languages; another for anything else (a
    layer more, another vocabulary); one dictionary per --vocab-size; one profile per batch."""
    cache = from_args.ModelCache()
    small = ["unused-data", "--task", "translation", "--arch", "transformer_nllb_tiny",
             "--max-tokens", "512", "--ddp-backend", "fsdp2"]
    args = from_args.parse([*small, "--vocab-size", "64"])
    model = cache.model(args)
    assert (args.source_lang, args.target_lang) == ("src", "tgt")  # named by the build
    for extra in ([], ["--max-tokens", "1024"], ["--batch-size", "2"], ["--seq-len", "32"],
                  ["--world-size", "2", "4"], ["--replicate-degree", "2"], ["--device", "cpu"],
                  ["--fit-gb", "3"], ["--cpu-baseline-gb", "1"]):
        assert cache.model(args) is cache.model(from_args.parse([*small, "--vocab-size", "64",
                                                                 *extra])) is model, extra
    deeper = cache.model(from_args.parse([*small, "--vocab-size", "64", "--encoder-layers", "3"]))
    assert len(deeper.encoder.layers) == 3 and len(model.encoder.layers) == 2
    assert deeper.encoder.dictionary is model.encoder.dictionary
    wider = cache.model(from_args.parse([*small, "--vocab-size", "72"]))
    assert len(wider.encoder.dictionary) == 72 and len(model.encoder.dictionary) == 64
    profile = cache.profile(args)
    assert cache.profile(from_args.parse([*small, "--vocab-size", "64", "--world-size", "8"])) \
        is profile
    longer = cache.profile(from_args.parse([*small, "--vocab-size", "64", "--max-tokens", "1024"]))
    assert longer.workload.tokens == 2 * profile.workload.tokens
