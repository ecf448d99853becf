"""The chunked vocabulary loss (fairseq_fsdp2/criterions/chunked.py).

1. Same losses and parameter gradients as fairseq's own criteria, for any chunk size.
2. Far lower peak memory for the loss at NLLB's vocabulary (256,206), measured on CPU with
   PyTorch's MemTracker (live tensor storages, no CUDA needed).
3. A real 2-rank fairseq-train run with FSDP2 (tied embedding in a grouped unit,
   --min-params-to-wrap 1, both --fsdp2-root-reshard settings): the same per-update losses, nll
   losses and gradient norms as the stock criterion, so the weight is gathered for the chunks
   and their recomputation.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fairseq import options
from fairseq.criterions import build_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.tasks.translation import TranslationTask
from torch.distributed._tools.mem_tracker import MemTracker

from numerics import FP32_REORDERED, U32, printed_close

from fairseq_fsdp2.criterions.chunked import (
    CrossEntropyChunkedCriterion,
    LabelSmoothedCrossEntropyChunkedCriterion,
)

ROOT = Path(__file__).resolve().parents[1]
NLLB_VOCAB = 256_206


def parse(dim: int, *extra: str):
    return options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", "transformer", "--share-all-embeddings", "--dropout", "0",
        "--encoder-layers", "1", "--decoder-layers", "1",
        "--encoder-embed-dim", str(dim), "--decoder-embed-dim", str(dim),
        "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", *extra])


def build(vocab: int, dim: int):
    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    args = parse(dim)
    task = TranslationTask(args, d, d)
    torch.manual_seed(0)
    return task, task.build_model(args)


def make_sample(d: Dictionary, batch: int, src_len: int, tgt_len: int, seed: int = 0,
                pad_from: tuple = ()):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(d.nspecial, len(d), (batch, src_len), generator=g)
    tgt = torch.randint(d.nspecial, len(d), (batch, tgt_len), generator=g)
    for row, start in enumerate(pad_from):  # right-padded targets, as fairseq batches them
        tgt[row, start:] = d.pad()
    prev = torch.roll(tgt, 1, 1)
    prev[:, 0] = d.eos()
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), src_len),
                          "prev_output_tokens": prev},
            "target": tgt, "ntokens": int(tgt.ne(d.pad()).sum())}


def loss_and_grads(criterion, model, sample):
    model.zero_grad(set_to_none=True)
    loss, sample_size, logging_output = criterion(model, sample)
    loss.backward()
    return sample_size, logging_output, {n: p.grad.clone() for n, p in model.named_parameters()}


# -- 1. equivalence --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    task, model = build(1000, 16)
    sample = make_sample(task.target_dictionary, 4, 6, 9, pad_from=(9, 4, 7, 1))
    return task, model, sample


def test_registered_with_option():
    args = parse(16, "--criterion", "label_smoothed_cross_entropy_chunked",
                 "--label-smoothing", "0.1", "--loss-chunk-tokens", "7")
    task = TranslationTask(args, Dictionary(), Dictionary())
    criterion = build_criterion(convert_namespace_to_omegaconf(args).criterion, task)
    assert type(criterion) is LabelSmoothedCrossEntropyChunkedCriterion
    assert (criterion.loss_chunk_tokens, criterion.eps) == (7, 0.1)

    args = parse(16, "--criterion", "cross_entropy_chunked")
    criterion = build_criterion(convert_namespace_to_omegaconf(args).criterion, task)
    assert type(criterion) is CrossEntropyChunkedCriterion
    assert criterion.loss_chunk_tokens == 1024


CASES = {  # name: (stock criterion, chunked criterion for a chunk size)
    "ls0.1": (lambda t: LabelSmoothedCrossEntropyCriterion(t, False, 0.1),
              lambda t, n: LabelSmoothedCrossEntropyChunkedCriterion(t, False, 0.1,
                                                                     loss_chunk_tokens=n)),
    "ls0": (lambda t: LabelSmoothedCrossEntropyCriterion(t, False, 0.0),
            lambda t, n: LabelSmoothedCrossEntropyChunkedCriterion(t, False, 0.0,
                                                                   loss_chunk_tokens=n)),
    "ls0.1-prefix-accuracy-sentavg": (
        lambda t: LabelSmoothedCrossEntropyCriterion(t, True, 0.1, ignore_prefix_size=1,
                                                     report_accuracy=True),
        lambda t, n: LabelSmoothedCrossEntropyChunkedCriterion(
            t, True, 0.1, ignore_prefix_size=1, report_accuracy=True, loss_chunk_tokens=n)),
    "ce": (lambda t: CrossEntropyCriterion(t, False),
           lambda t, n: CrossEntropyChunkedCriterion(t, False, loss_chunk_tokens=n)),
}


def rounding_scale(model, sample) -> int:
    """How many float32 roundings a loss term or gradient element may differ by between the two
    criteria: each per-token value is a dot product over the model dim C (the logit) and a
    log-softmax over the vocabulary V, computed on other tensor shapes (other kernel blocking),
    and the per-token values are summed over the T target tokens in another order. A sum of n
    terms, reassociated, differs by at most n x U32 x (sum of the terms' magnitudes)."""
    c, v = model.decoder.output_projection.weight.shape[::-1]
    return int(sample["target"].numel()) + c + v


def gradient_mass(criterion, model, sample) -> dict[str, torch.Tensor]:
    """Per parameter element: the sum over target tokens of |d loss_token / d element|, the
    magnitude that the reassociated sum over tokens rounds with."""
    losses = criterion(model, sample, reduce=False)[0].reshape(-1)
    params = dict(model.named_parameters())
    mass = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(losses.numel()):
        grads = torch.autograd.grad(losses[i], list(params.values()), retain_graph=True,
                                    allow_unused=True)
        for name, g in zip(params, grads):
            if g is not None:
                mass[name] += g.abs()
    return mass


MASS: dict[str, dict[str, torch.Tensor]] = {}


# chunk size 0 is not among these: it runs the parent criterion, which compared with itself
# proves nothing (test_chunk_size_0_and_unreduced_run_the_parent_criterion shows that it does)
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
@pytest.mark.parametrize("case", list(CASES))
def test_same_loss_and_gradients_as_stock(small, case, chunk):
    task, model, sample = small
    stock, chunked = CASES[case]
    size, log, grads = loss_and_grads(stock(task), model, sample)
    c_size, c_log, c_grads = loss_and_grads(chunked(task, chunk), model, sample)
    n = rounding_scale(model, sample)

    assert c_size == size and c_log.keys() == log.keys()
    for key in log:  # counts are exact; losses are sums of positive per-token terms
        a, b = float(c_log[key]), float(log[key])
        assert abs(a - b) <= n * U32 * abs(b), (key, a, b)
    # Rounding errors enter along the whole backward chain (other shapes, other blocking) and
    # are relative to the values flowing through it, so each tensor's bound is n x U32 x its
    # largest gradient mass (not element by element: an element's own mass can be small by
    # cancellation further up the chain, seen on fc1.weight).
    if case not in MASS:  # the same for every chunk size: computed once per case
        MASS[case] = gradient_mass(stock(task), model, sample)
    mass = MASS[case]
    largest = max(m.max() for m in mass.values())
    for name in grads:
        bound = n * U32 * mass[name].max()
        if name.endswith("k_proj.bias"):
            # exact gradient zero (softmax ignores a constant added to every key score): each
            # token's own gradient is already rounding noise, so its mass bounds nothing; both
            # criteria's values must be noise: below the rounding of the largest element
            bound = n * U32 * largest
        worst = ((c_grads[name] - grads[name]).abs() - bound).max().item()
        assert worst <= 0, f"{name}: exceeds n x U32 x gradient mass by {worst:.3g}"


def output_projection_inputs(criterion, model, sample, **kwargs) -> list[tuple]:
    """Shapes of the inputs the output projection saw in one forward + backward."""
    shapes = []
    hook = model.decoder.output_projection.register_forward_hook(
        lambda module, args, out: shapes.append(tuple(args[0].shape)))
    try:
        loss = criterion(model, sample, **kwargs)[0]
        loss.sum().backward()
    finally:
        hook.remove()
    return shapes


@pytest.mark.parametrize("case", list(CASES))
def test_chunk_size_0_and_unreduced_run_the_parent_criterion(small, case):
    """--loss-chunk-tokens 0 (and reduce=False, which needs per-token losses) is the parent
    criterion's code: one projection of the whole batch x length (padding included), no
    recomputation; with chunks, the projection sees at most N non-padding tokens at a time,
    twice (forward and the recomputation in backward)."""
    task, model, sample = small
    _, chunked = CASES[case]
    batch, length = sample["target"].shape
    dim = model.decoder.output_projection.in_features
    assert output_projection_inputs(chunked(task, 0), model, sample) == [(batch, length, dim)]
    assert output_projection_inputs(chunked(task, 7), model, sample, reduce=False) == \
        [(batch, length, dim)]
    chunks = output_projection_inputs(chunked(task, 7), model, sample)
    tokens = sample["target"].ne(task.target_dictionary.pad())
    if "prefix" in case:  # ignore_prefix_size=1: the first target position is not scored
        tokens = tokens[:, 1:]
    sizes = [min(7, int(tokens.sum()) - i) for i in range(0, int(tokens.sum()), 7)]
    assert chunks[:len(sizes)] == [(n, dim) for n in sizes]  # forward, in order
    assert sorted(chunks[len(sizes):]) == sorted(chunks[:len(sizes)])  # backward recomputes


# -- 2. peak memory --------------------------------------------------------------------------

def loss_step_peak(criterion, model, sample) -> tuple[int, float]:
    """Peak bytes of live tensors (parameters included) over the loss forward + backward."""
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss, _, _ = criterion(model, sample)
        loss.backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], loss.item()


def test_peak_memory_at_nllb_vocabulary():
    tokens, dim, chunk = 512, 32, 64
    task, model = build(NLLB_VOCAB, dim)
    sample = make_sample(task.target_dictionary, 8, 8, tokens // 8)
    stock, stock_loss = loss_step_peak(LabelSmoothedCrossEntropyCriterion(task, False, 0.1),
                                       model, sample)
    chunked, chunked_loss = loss_step_peak(
        LabelSmoothedCrossEntropyChunkedCriterion(task, False, 0.1, loss_chunk_tokens=chunk),
        model, sample)
    report = (f"loss step peak at {tokens} target tokens x {NLLB_VOCAB:,} vocabulary, dim {dim}: "
              f"stock {stock / 2**20:.0f} MiB, chunked ({chunk} tokens) {chunked / 2**20:.0f} "
              f"MiB, {stock / chunked:.1f}x lower")
    print(report)
    # the same loss (a sum of positive terms) up to its reassociated float32 rounding
    assert abs(chunked_loss - stock_loss) <= rounding_scale(model, sample) * U32 * stock_loss
    assert stock >= 4 * chunked, report


# -- 3. FSDP2 through fairseq-train ----------------------------------------------------------

def fsdp2_train_args(data: Path, save_dir: Path, criterion: str, *extra: str) -> list[str]:
    return [
        str(data), "--save-dir", str(save_dir), "--user-dir", str(ROOT / "fairseq_fsdp2"),
        "--task", "translation", "--arch", "transformer", "--share-all-embeddings",
        "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--max-update", "4",
        "--log-format", "json", "--log-interval", "1", "--seed", "1", "--cpu",
        "--no-progress-bar", "--no-save", "--disable-validation",
        "--ddp-backend", "fsdp2", "--min-params-to-wrap", "1",
        "--criterion", criterion, "--label-smoothing", "0.1", *extra]


def test_fsdp2_two_ranks_match_stock_criterion(tmp_path, corpus):
    from launcher import run_ranks, train_inner

    def train(criterion, *extra):
        args = fsdp2_train_args(corpus, tmp_path / "out", criterion, *extra)
        results = run_ranks(2, lambda rank: args, timeout=180, module="fairseq_cli.train")
        for r in results:
            assert r.returncode == 0, f"rank {r.rank} failed:\n{r.output[-4000:]}"
        records = train_inner(results[0].output)
        assert len(records) == 4, results[0].output[-3000:]
        return [{k: rec[k] for k in ("loss", "nll_loss", "gnorm")} for rec in records]

    chunked = train("label_smoothed_cross_entropy_chunked", "--loss-chunk-tokens", "64")
    stock = train("label_smoothed_cross_entropy")
    chunked_resharded = train("label_smoothed_cross_entropy_chunked", "--loss-chunk-tokens", "64",
                              "--fsdp2-root-reshard", "always")
    for run in (chunked, chunked_resharded):
        for got, want in zip(run, stock):
            for key in want:  # printed to 3 decimals; float32 sums in another order
                assert printed_close(got[key], want[key], FP32_REORDERED), (key, run, stock)
