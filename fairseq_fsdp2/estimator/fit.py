"""The largest ``--max-tokens`` whose predicted per-rank peak fits a memory budget
(``python -m fairseq_fsdp2.estimate ... --fit-gb G``).

fairseq forms batches of ``max_tokens // seq_len`` sentences, rounded down to
``--required-batch-size-multiple`` (model_profile.workload_for), so only multiples of
seq_len x that multiple give different batches: the search runs over those, by bisection (the
predicted peak does not fall as the batch grows), each step one trace of the model built once on
the meta device. A budget too small for one batch of the multiple gives None.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from .from_args import ModelCache, setup_for
from .peak import estimate

#: the largest --max-tokens tried: 64 times the granularity (65,536 tokens at 128-token
#: sentences and batches of multiples of 8)
MAX_STEPS = 64


@dataclass(frozen=True)
class Fit:
    world_size: int
    budget_gb: float
    max_tokens: Optional[int]  # None: not even the smallest batch fits
    peak_gb: Optional[float]  # the prediction at max_tokens
    capped: bool  # the largest tried fits: more may fit

    def line(self) -> str:
        if self.max_tokens is None:
            return (f"{self.world_size} rank(s): no --max-tokens fits {self.budget_gb:g} GiB "
                    f"per rank")
        more = " (the largest tried; more may fit)" if self.capped else ""
        return (f"{self.world_size} rank(s): the largest --max-tokens that fits "
                f"{self.budget_gb:g} GiB per rank is {self.max_tokens}{more}, predicted "
                f"{self.peak_gb:.2f} GiB")


def largest_max_tokens(args, budget_gb: float, world_sizes, claimed: Optional[dict] = None,
                       models: Optional[ModelCache] = None) -> list[Fit]:
    """For each of ``world_sizes``, bisection over the --max-tokens values that give different
    batches (module docstring). The profile of a batch (one trace) does not depend on the world
    size: each is made once for all of them.

    ``claimed``: world size -> a --max-tokens said to be the answer (None: that none fits), as a
    document records it. A claim is checked at its edge only (it fits and the next batch does
    not, or the smallest does not fit), two traces instead of the search's eight; since the
    peak does not fall as the batch grows, a claim that holds there is what the search finds.
    One that does not hold is searched for as without a claim.

    ``models``: where the model and its profiles are taken from (the caller's, e.g. the
    estimate command's for its estimates too; without, this search's own)."""
    step = args.seq_len * max(int(getattr(args, "required_batch_size_multiple", 8) or 1), 1)
    models = models if models is not None else ModelCache()

    def profile(k: int):
        trial = copy.copy(args)
        trial.max_tokens = k * step
        return models.profile(trial)

    def search(world_size: int) -> Fit:
        setup = setup_for(args, world_size)

        def peak(k: int) -> float:
            return estimate(profile(k), setup).peak_gb

        tokens = (claimed or {}).get(world_size, ())
        if tokens is None and peak(1) > budget_gb:  # claimed: none fits
            return Fit(world_size, budget_gb, None, None, False)
        if isinstance(tokens, int) and tokens % step == 0 and 1 <= tokens // step <= MAX_STEPS:
            k = tokens // step
            if peak(k) <= budget_gb and (k == MAX_STEPS or peak(k + 1) > budget_gb):
                return Fit(world_size, budget_gb, tokens, peak(k), k == MAX_STEPS)
        if peak(1) > budget_gb:
            return Fit(world_size, budget_gb, None, None, False)
        low, high = 1, MAX_STEPS  # peak(low) fits
        if peak(high) <= budget_gb:
            return Fit(world_size, budget_gb, high * step, peak(high), True)
        while high - low > 1:  # peak(high) does not fit
            middle = (low + high) // 2
            low, high = (middle, high) if peak(middle) <= budget_gb else (low, middle)
        return Fit(world_size, budget_gb, low * step, peak(low), False)

    return [search(w) for w in world_sizes]
