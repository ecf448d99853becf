"""(not a test; `.venv/bin/python scripts/benchmark_loss_alone.py`, env TOKENS, DIM, ROUNDS)
In-process side-by-side timing of the vocabulary loss alone (projection + log-softmax +
label-smoothed loss, forward + backward): stock formulas vs the fused chunked pass.
Interleaved rounds, median per config; the ratio is what counts (machine shared)."""
import statistics, sys, time, os
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq_fsdp2.criterions.fused import fused_vocabulary_loss
torch.manual_seed(0)
V, D, N = 256206, int(os.environ.get("DIM", 128)), int(os.environ.get("TOKENS", 672))
x0 = torch.randn(N, D) * 0.5
w = torch.nn.Parameter(torch.randn(V, D) * D ** -0.5)
t = torch.randint(4, V, (N,))
def stock():
    x = x0.clone().requires_grad_()
    lp = torch.log_softmax((x @ w.t()).float(), -1)
    loss, _ = label_smoothed_nll_loss(lp, t, 0.1, ignore_index=1, reduce=True)
    loss.backward()
def fused(n):
    def f():
        x = x0.clone().requires_grad_()
        loss, _, _ = fused_vocabulary_loss(x, w, t, eps=0.1, chunk_tokens=n)
        loss.backward()
    return f
configs = {"stock": stock, **{f"fused {n}": fused(n) for n in (64, 256, 1024)}}
times = {k: [] for k in configs}
for r in range(int(os.environ.get("ROUNDS", 5))):
    for k, f in configs.items():
        w.grad = None
        t0 = time.perf_counter(); f(); times[k].append(time.perf_counter() - t0)
    print(r, {k: round(v[-1], 3) for k, v in times.items()}, flush=True)
med = {k: statistics.median(v) for k, v in times.items()}
print(f"tokens {N}, dim {D}, vocab {V}, torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()}")
for k, v in med.items():
    print(f"{k}: median {v:.3f} s, stock/this {med['stock'] / v:.2f}x")
