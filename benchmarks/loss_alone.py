"""In-process side-by-side timing of the vocabulary loss alone (not a test): projection +
log-softmax + label-smoothed loss, forward + backward, fairseq's stock formulas against the
fused chunked pass (criterions/fused.py) at 64, 256 and 1024 tokens a chunk. Interleaved rounds,
median per config; the ratio is what counts (the machine is shared).
scripts/benchmark_loss_alone.py reads the sizes (env TOKENS, DIM, ROUNDS)."""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from fairseq_fsdp2.criterions.fused import fused_vocabulary_loss

VOCAB = 256206


def main(tokens: int, dim: int, rounds: int) -> None:
    """Time ``rounds`` interleaved rounds of each config and print the medians."""
    torch.manual_seed(0)
    x0 = torch.randn(tokens, dim) * 0.5
    w = torch.nn.Parameter(torch.randn(VOCAB, dim) * dim ** -0.5)
    t = torch.randint(4, VOCAB, (tokens,))

    def stock() -> None:
        x = x0.clone().requires_grad_()
        lp = torch.log_softmax((x @ w.t()).float(), -1)
        loss, _ = label_smoothed_nll_loss(lp, t, 0.1, ignore_index=1, reduce=True)
        loss.backward()

    def fused(n: int) -> Callable[[], None]:
        def f() -> None:
            x = x0.clone().requires_grad_()
            loss, _, _ = fused_vocabulary_loss(x, w, t, eps=0.1, chunk_tokens=n)
            loss.backward()
        return f

    configs = {"stock": stock, **{f"fused {n}": fused(n) for n in (64, 256, 1024)}}
    times: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(rounds):
        for k, f in configs.items():
            w.grad = None
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
        print(r, {k: round(v[-1], 3) for k, v in times.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"tokens {tokens}, dim {dim}, vocab {VOCAB}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, load {os.getloadavg()}")
    for k, v in med.items():
        print(f"{k}: median {v:.3f} s, stock/this {med['stock'] / v:.2f}x")
