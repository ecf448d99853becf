"""--fsdp2-memory-breakdown N (per-rank memory by category for update N) and
the tied-gradient buffer (one gradient buffer for the tied embedding; the default,
--fsdp2-no-tied-grad-buffer turns it off).

Three real 2-rank fairseq-train runs share the work: an NLLB-layout model (grouped shared-
embedding unit plus per-layer units) on a 20,000-word vocabulary, so that the tied
vocab x dim weight is most of the model, with the chunked loss (its logits stay small, so the
tied gradient decides the peak). One run is the stock FSDP2 path (saving: the JSON is written),
the others use the tied-gradient buffer (--no-save: the table is only printed), reduced by
FSDP2 (--fsdp2-no-tied-early-reduce) and early (the default): that pair also serves
tests/test_tied_early_reduce.py's fp32 check of the early reduce against FSDP2's reduction.
The stock run makes an update after the recorded one (not recorded: one table); the other two
stop at the recorded update, and their per-update values are compared with the stock run's
first ones.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from conftest import PLUGIN
from numerics import FP32_REORDERED, U32, assert_runs_close, first_updates
from launcher import ok, run_ranks

from fairseq_fsdp2.sharding import tied_grad_buffer
from fairseq_fsdp2.data.synthetic import write_random_corpus
from fairseq_fsdp2.errors import OptionError
from fairseq_fsdp2.memory.breakdown import FILE_NAME
from fairseq_fsdp2.memory.tracker import Category
from fairseq_fsdp2.options import FSDP2DistributedTrainingConfig, validate

VOCAB, DIM = 20_000, 64  # transformer_nllb_tiny's dim
TIED_BYTES = VOCAB * DIM * 4  # one fp32 vocab x dim gradient (5.1 MB)
UPDATE = 2
MAX_TOKENS = 144


def train_args(data: Path, save_dir: Path, *extra: str, updates: int) -> list[str]:
    return [str(data), "--user-dir", PLUGIN, "--task", "translation",
            "--arch", "transformer_nllb_tiny", "--optimizer", "adam", "--lr", "1e-3",
            "--criterion", "label_smoothed_cross_entropy_chunked", "--loss-chunk-tokens", "16",
            "--label-smoothing", "0.1", "--max-tokens", str(MAX_TOKENS),
            "--max-update", str(updates), "--log-format", "json", "--log-interval", "1",
            "--seed", "1", "--cpu", "--no-progress-bar", "--disable-validation",
            "--save-dir", str(save_dir),
            "--no-epoch-checkpoints", "--no-last-checkpoints", "--fsdp2-no-consolidate",
            "--ddp-backend", "fsdp2", "--min-params-to-wrap", "1",
            "--fsdp2-memory-breakdown", str(UPDATE), *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("breakdown")
    data = write_random_corpus(root / "corpus", vocab=VOCAB, words=8, n_train=64)
    out = {}
    for name, extra, updates in (("stock", ["--fsdp2-no-tied-grad-buffer"], UPDATE + 1),
                                 # the buffer reduce-scattered by FSDP2, and reduced early (the
                                 # default): update 1 before the recorded one, none after
                                 ("buffer", ["--no-save", "--fsdp2-no-tied-early-reduce"], UPDATE),
                                 ("early", ["--no-save"], UPDATE)):
        save_dir = root / name
        output = ok(run_ranks(2, lambda r: train_args(data, save_dir, *extra, updates=updates)))
        path = save_dir / FILE_NAME
        out[name] = {"output": output, "json": path}
    return out


@pytest.mark.slow
def test_json_has_a_column_per_rank_and_consistent_categories(runs):
    doc = json.loads(runs["stock"]["json"].read_text())
    assert doc["update"] == UPDATE and doc["units"] == "bytes"
    assert doc["categories"] == [c.value for c in Category]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    model_bytes = 4 * int(next(line for line in runs["stock"]["output"].splitlines()
                               if "FSDP2 sharding plan" in line)
                          .split(" parameters")[0].rsplit(" ", 1)[1].replace(",", ""))
    # the same rank's process peak at that update (VmHWM, memory.jsonl): an outside measure
    rss = next(json.loads(line) for line in (runs["stock"]["json"].parent / "memory.jsonl")
               .read_text().splitlines() if json.loads(line)["num_updates"] == UPDATE)
    for r in doc["ranks"]:
        at, mx = r["at_peak"], r["max"]
        # The tracked peak against what must be alive at it, counted from the model size, not
        # by the tracker: this rank's fp32 shards (1/2) and Adam's two moments of them, and the
        # shared vocab x dim weight, gathered for the output projection while its backward
        # runs (the root default keeps it gathered from forward to backward), plus the
        # gradient of that projection (one vocab x dim tensor at least).
        floor = model_bytes / 2 * 3 + 2 * TIED_BYTES
        assert floor <= r["peak_bytes"], (floor, r["peak_bytes"])
        # and against the process: tensors are part of the resident memory, which also holds
        # the interpreter and libraries (hundreds of MiB), so the tracked peak is well below
        process = next(x for x in rss["ranks"] if x["rank"] == r["rank"])["peak_gb"] * 2 ** 30
        assert r["peak_bytes"] < process, (r["peak_bytes"], process)
        for c in doc["categories"]:
            assert 0 <= at[c] <= mx[c]
        # each rank holds half the model (+ padding of uneven dim-0 shards), Adam two moments
        assert model_bytes / 2 <= at["sharded params"] <= model_bytes / 2 * 1.02
        assert 1.9 <= at["optimizer state"] / at["sharded params"] <= 2.05
        # the grouped unit (encoder/decoder embedding + output projection) is gathered whole
        # in forward: its vocab x dim weight counts as gathered params there
        assert r["max_by_phase"]["forward"]["gathered params"] >= TIED_BYTES
        assert mx["comm buffers"] >= TIED_BYTES  # its all-gather and reduce-scatter buffers
        assert mx["sharded grads"] >= at["sharded params"] * 0.98
        assert mx["activations"] > 0 and mx["logits/loss"] > 0
        assert 1 <= len(r["top_modules"]) <= 5
        assert r["peak_phase"] in ("forward", "backward", "optimizer step", "other")


@pytest.mark.slow
def test_only_update_n_is_recorded_and_printed_as_one_table(runs):
    for run in runs.values():
        out = run["output"]
        assert out.count("memory breakdown of update") == 1
        assert f"memory breakdown of update {UPDATE} on cpu" in out
        table = out.split("memory breakdown of update", 1)[1].splitlines()
        assert table[1].split() == ["rank", "0", "rank", "1"]
        assert [line.split("  ")[0] for line in table[4:4 + len(Category)]] == \
            [c.value for c in Category]
    assert not runs["buffer"]["json"].exists()  # --no-save: printed only


@pytest.mark.slow
def test_tied_grad_buffer_trains_the_same_with_less_memory(runs):
    # the same gradients summed in another order (the gradients themselves agree to float
    # rounding: test_tied_grad_buffer_gradients_equal_stock): FP32_REORDERED on the printed
    # values, with their rounding (numerics.printed_close)
    assert_runs_close(runs["buffer"]["output"], first_updates(runs["stock"]["output"], UPDATE),
                      FP32_REORDERED, UPDATE)
    before = json.loads(runs["stock"]["json"].read_text())["ranks"]
    after = printed_table(runs["buffer"]["output"])
    grads = "grads before reduce-scatter"
    for r, (_, grads_max), (peak, _) in zip(before, after[grads], after["peak (tracked)"]):
        # stock: the uses' vocab x dim gradients coexist (3 of them); the buffer: one
        assert r["max"][grads] >= 2.5 * TIED_BYTES
        assert grads_max <= 1.3 * TIED_BYTES
        # the rank's peak drops by about one of them: it moves to the reduce-scatter of the
        # shared unit, where the buffer and FSDP2's reduce-scatter copy of it coexist
        assert peak <= r["peak_bytes"] - 0.75 * TIED_BYTES


@pytest.mark.slow
def test_tied_early_reduce_trains_the_same_and_costs_at_most_the_shard(runs):
    """Reduced early (sharding/tied_grad_reduce.py) the tied weight's gradient is never handed
    to FSDP2, and its buffer lives from the fused loss's forward to the start of backward
    only. What it costs: at that start, where this small-vocabulary model's activations are
    largest, the buffer and this rank's reduced shard (its half, fp32: TIED_BYTES / 2) are
    alive together; every later moment holds the shard and the looked-up rows instead of the
    buffer, and the end of backward no FSDP2 copy of it. So the tracked peak is at most the
    buffer's plus that half (the estimator predicts the same: the peak at "loss backward: tied
    gradient reduced early", about 1.2 MB above the buffer's here; at NLLB's vocabulary with
    --checkpoint-activations the peak falls instead, docs/memory.md)."""
    assert_runs_close(runs["early"]["output"], first_updates(runs["stock"]["output"], UPDATE),
                      FP32_REORDERED, UPDATE)
    buffer, early = (printed_table(runs[n]["output"]) for n in ("buffer", "early"))
    grads = "grads before reduce-scatter"
    for (_, grads_max), (peak_buffer, _), (peak, _) in zip(
            early[grads], buffer["peak (tracked)"], early["peak (tracked)"]):
        print(f"tracked peak: buffer {peak_buffer:.0f}, early {peak:.0f} bytes (one vocab x dim "
              f"gradient: {TIED_BYTES})")
        assert grads_max <= 1.3 * TIED_BYTES  # the one buffer, never more
        assert peak <= peak_buffer + TIED_BYTES / 2


@pytest.mark.slow
def test_tied_early_reduce_matches_fsdp2s_reduction_in_fp32(runs):
    """tests/test_tied_early_reduce.py's fairseq-train check in fp32, on these runs (its fp16
    case runs there): per update, loss and gradient norm of the early reduce against FSDP2
    reducing the buffer (--fsdp2-no-tied-early-reduce), fused chunked loss, 2 ranks.

    The rows' exchange is what runs: each rank's lookups are at most 2 x MAX_TOKENS rows
    (source and target tokens), and 2 ranks' of them fit the dense gradient's bytes (asserted
    with the rule itself). DERIVED tolerance (as there): the two runs differ only in how the tied weight's
    gradient is grouped: FSDP2 sums (projection + src lookup + tgt lookup) per rank, then over
    the 2 ranks; the early reduce the projections over the ranks, then each lookup's rows (the
    projection's chunks summed alike, into the same buffer, in both). Each lookup's rows one
    term: 6 terms per element, each addition rounding by at most u of the terms' magnitude in
    either order: 2 x (6 + 1) x U32 per element, which moves the gradient norm and Adam's step
    by at most that fraction (the triangle inequality; m / sqrt(v) per element), over these 2
    updates."""
    from fairseq_fsdp2.sharding.tied_grad_reduce import sparse_fits
    assert sparse_fits(2 * 2 * MAX_TOKENS, DIM, 4, VOCAB)
    early, buffer = runs["early"]["output"], runs["buffer"]["output"]
    assert "reduced into this rank's shard" in early
    assert "reduced into this rank's shard" not in buffer
    assert_runs_close(early, buffer, 2 * (6 + 1) * U32, UPDATE)


def printed_table(output: str) -> dict[str, list[tuple[float, float]]]:
    """The logged table: row name -> per rank (at the peak, max) in bytes."""
    lines = output.split("memory breakdown of update", 1)[1].splitlines()
    unit = 2 ** 20 if "(MiB;" in lines[0] else 2 ** 10
    rows = {}
    for line in lines[2:]:
        if re.match(r"\d{4}-\d\d-\d\d ", line) or not line.strip():
            break
        name, *cells = re.split(r"\s{2,}", line.strip())
        if name == "peak during" or not cells:
            continue
        values = []
        for cell in cells:
            at, _, mx = cell.replace(",", "").partition(" / ")
            values.append((float(at) * unit, float(mx or at) * unit))
        rows[name] = values
    return rows


def test_negative_update_is_rejected():
    dt = FSDP2DistributedTrainingConfig()
    dt.fsdp2_memory_breakdown = -1
    with pytest.raises(OptionError, match="--fsdp2-memory-breakdown must be >= 0"):
        validate(dt, min_params_to_wrap=1, fp16=False, bf16=False, world_size=1)


class _Tied(nn.Module):
    """Encoder/decoder lookups and an output projection sharing one weight (as NLLB)."""

    def __init__(self, vocab: int = 50, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=1)
        self.layer = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, src, tgt, chunked=False):
        x = self.layer(self.embed(src)).mean(1, keepdim=True)
        y = torch.tanh(self.embed(tgt) + x)
        if chunked:  # as the chunked loss: projection recomputed in backward
            return sum(checkpoint(lambda c: self.out(c).log_softmax(-1).sum(), c,
                                  use_reentrant=False) for c in y.split(2, dim=1))
        return self.out(y).log_softmax(-1).sum()


def tied_weight_terms(model: _Tied, src, tgt, micro_batches: int):
    """Per element of the tied weight, the terms both runs add into its gradient, from float64
    values of the same model and data: the sum of their magnitudes and how many there are. Per
    micro-batch: the projection's products |dL/dlogit_tv| x |y_tj|, one per target token, and
    each lookup's row |dL/de| (padding's excluded: it gets none)."""
    m = copy.deepcopy(model).double()
    weight = m.embed.weight
    looked_up = {"src": (src, m.embed(src)), "tgt": (tgt, m.embed(tgt))}
    y = torch.tanh(looked_up["tgt"][1] + m.layer(looked_up["src"][1]).mean(1, keepdim=True))
    logits = y @ weight.t()
    for t in (*(e for _, e in looked_up.values()), logits):
        t.retain_grad()
    logits.log_softmax(-1).sum().backward()
    vocab, dim = weight.shape
    terms = logits.grad.reshape(-1, vocab).abs().t() @ y.detach().reshape(-1, dim).abs()
    count = torch.full((vocab,), float(tgt.numel()), dtype=torch.float64)
    for tokens, e in looked_up.values():
        index = tokens.reshape(-1)
        real = index != m.embed.padding_idx
        terms.index_add_(0, index[real], e.grad.reshape(-1, dim)[real].abs())
        count.index_add_(0, index[real], torch.ones(int(real.sum()), dtype=torch.float64))
    return micro_batches * terms, micro_batches * count


@pytest.mark.parametrize("chunked", [False, True])
def test_tied_grad_buffer_gradients_equal_stock(chunked):
    torch.manual_seed(0)
    stock = _Tied()
    ours = copy.deepcopy(stock)
    assert tied_grad_buffer.install(ours) == [["embed", "out"]]
    assert ours.out.weight is ours.embed.weight
    src, tgt = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 5))
    src[0, :2] = tgt[1, 3] = 1  # padding: its row gets no gradient from the lookups
    micro_batches = 2  # accumulated into .grad
    for model in (stock, ours):
        for _ in range(micro_batches):
            model(src, tgt, chunked).backward()
    # The buffer changes only where the tied weight's terms are summed (other groupings, into
    # one buffer): every other gradient comes from the same ops on the same values, bit for bit
    for (name, a), b in zip(stock.named_parameters(), ours.parameters()):
        if name != "embed.weight":
            assert torch.equal(a.grad, b.grad), name
    # The tied weight: each run's element is a float32 sum of the same M terms (each a product
    # or a row, itself rounded: M + 1 roundings) in some order, so within gamma(M + 1) x the
    # sum of their magnitudes of the exact sum, and the two within twice that; twice the
    # float64 magnitudes cover their float32 values (which differ by the depth of the network
    # times U32, relatively).
    terms, count = tied_weight_terms(stock, src, tgt, micro_batches)
    m = count[:, None] + 1
    tol = 2 * (m * U32 / (1 - m * U32)) * 2 * terms
    diff = (stock.embed.weight.grad.double() - ours.embed.weight.grad.double()).abs()
    print(f"chunked={chunked}: largest |buffer - stock| / tolerance {(diff / tol).max():.3g}")
    assert (diff <= tol).all(), (diff / tol).max()
    with torch.no_grad():
        assert torch.equal(stock(src, tgt), ours(src, tgt))
