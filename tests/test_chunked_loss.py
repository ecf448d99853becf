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

import json
import copy
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

from numerics import U32

from fairseq_fsdp2.sharding import tied_grad_buffer
from fairseq_fsdp2.criterions.chunked import (
    CrossEntropyChunkedCriterion,
    LabelSmoothedCrossEntropyChunkedCriterion,
)
from fairseq_fsdp2.criterions.fused import chunk_bytes, float_rows, fused_pass

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
    assert criterion.loss_chunk_tokens == 256


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


def near_ties(model, sample, criterion) -> int:
    """How many target tokens (those the accuracy counts) could change their argmax between
    the two criteria: both project the same decoder features x with the same weight W, in other
    shapes, so each logit differs by at most 2 gamma(C) x (|x| @ |W|^T) (a dot product of C
    terms, in any order); a token whose best two logits are within twice its largest such bound
    of each other may flip, no other can."""
    with torch.no_grad():
        features, _ = model(**sample["net_input"], features_only=True)
        weight = model.decoder.output_projection.weight
        logits = (features @ weight.t()).double()
        c = weight.shape[1]
        bound = 2 * c * U32 / (1 - c * U32) * (features.abs().double() @ weight.abs().double().t())
    target = sample["target"]
    skip = getattr(criterion, "ignore_prefix_size", 0)
    logits, bound, target = logits[:, skip:], bound[:, skip:], target[:, skip:]
    real = target.ne(criterion.padding_idx)
    top = logits.topk(2, dim=-1).values
    close = (top[..., 0] - top[..., 1]) <= 2 * bound.amax(-1)
    return int((close & real).sum())


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
        if key == "n_correct":  # a count of argmaxes: equal but at near-ties
            assert abs(a - b) <= near_ties(model, sample, CASES[case][0](task)), (key, a, b)
        else:
            assert abs(a - b) <= n * U32 * abs(b), (key, a, b)
    # Rounding errors enter along the whole backward chain (other shapes, other blocking) and
    # are relative to the values flowing through it, so each tensor's bound is n x U32 x its
    # largest gradient mass (not element by element: an element's own mass can be small by
    # cancellation further up the chain, seen on fc1.weight).
    assert_gradients_within_rounding(c_grads, grads, case_mass(task, model, sample, case), n)


def case_mass(task, model, sample, case: str) -> dict[str, torch.Tensor]:
    """gradient_mass of the case's stock criterion (the same for every chunk size: computed
    once per case)."""
    if case not in MASS:
        MASS[case] = gradient_mass(CASES[case][0](task), model, sample)
    return MASS[case]


def assert_gradients_within_rounding(got: dict, want: dict, mass: dict, n: int) -> None:
    """Each tensor's gradients within n x U32 x its largest gradient mass (rounding_scale)."""
    largest = max(m.max() for m in mass.values())
    for name in want:
        bound = n * U32 * mass[name].max()
        if name.endswith("k_proj.bias"):
            # exact gradient zero (softmax ignores a constant added to every key score): each
            # token's own gradient is already rounding noise, so its mass bounds nothing; both
            # criteria's values must be noise: below the rounding of the largest element
            bound = n * U32 * largest
        worst = ((got[name] - want[name]).abs() - bound).max().item()
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
    criterion's code: one call of the projection module on the whole batch x length (padding
    included); with chunks, the fused pass projects the chunks itself (criterions/fused.py)
    and never calls the module, in forward or backward."""
    task, model, sample = small
    _, chunked = CASES[case]
    batch, length = sample["target"].shape
    dim = model.decoder.output_projection.in_features
    assert output_projection_inputs(chunked(task, 0), model, sample) == [(batch, length, dim)]
    assert output_projection_inputs(chunked(task, 7), model, sample, reduce=False) == \
        [(batch, length, dim)]
    assert output_projection_inputs(chunked(task, 7), model, sample) == []


def test_fused_loss_does_the_stock_projection_flops(small):
    """No second projection: counted by torch's FLOP counter over forward + backward, the fused
    loss does the stock criterion's three tokens x vocabulary x dim matmuls (the logits, the
    features' gradient, the weight's gradient), over the non-padding tokens it projects, and
    the rest of the model's matmuls are the same. (The earlier chunked loss recomputed the
    logits in backward: a fourth, 2 x tokens x dim x vocabulary more.) Exact integers."""
    from torch.utils.flop_counter import FlopCounterMode

    def addmm_inplace(self_shape, a_shape, b_shape, *args, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    task, model, sample = small
    stock, chunked = CASES["ls0.1"]
    flops = []
    for criterion in (stock(task), chunked(task, 7)):
        model.zero_grad(set_to_none=True)
        # torch's table counts addmm but not its in-place form, with which the fused pass adds
        # every chunk after the first into the weight gradient: count it the same way
        with FlopCounterMode(display=False,
                             custom_mapping={torch.ops.aten.addmm_: addmm_inplace}) as counter:
            criterion(model, sample)[0].backward()
        flops.append(counter.get_total_flops())
    vocab, dim = model.decoder.output_projection.weight.shape
    batch, length = sample["target"].shape
    projected = int(sample["target"].ne(task.target_dictionary.pad()).sum())
    assert projected < batch * length  # the sample has padding, which stock projects too
    rest = flops[0] - 3 * 2 * batch * length * dim * vocab
    assert flops[1] - rest == 3 * 2 * projected * dim * vocab, (flops, rest)


def test_dummy_batch_and_validation(small):
    """fairseq zeroes a dummy batch's loss in place (``loss *= 0``): every gradient is then 0;
    without grad mode (validation) the same loss comes out of the gradient-free pass."""
    task, model, sample = small
    criterion = CASES["ls0.1-prefix-accuracy-sentavg"][1](task, 5)
    model.zero_grad(set_to_none=True)
    loss, _, log = criterion(model, sample)
    value = float(loss)
    loss *= 0
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    with torch.no_grad():
        _, _, valid = criterion(model, sample)
    assert float(valid["loss"]) == value and valid["n_correct"] == log["n_correct"]


def test_tied_buffer_receives_the_weight_gradient_in_forward(small):
    """With --fsdp2-tied-grad-buffer the chunks add into the tied weight's one buffer (created
    in forward, before any backward); that very buffer becomes the weight's gradient."""
    task, model, sample = small
    stock = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    _, _, want = loss_and_grads(stock, model, sample)
    ours = copy.deepcopy(model)
    assert tied_grad_buffer.install(ours)  # encoder/decoder embedding + output projection
    criterion = LabelSmoothedCrossEntropyChunkedCriterion(task, False, 0.1, loss_chunk_tokens=7)
    loss, _, _ = criterion(ours, sample)
    hub = ours.decoder.output_projection.tied_gradient._current[2]
    buffer = hub.buffer
    assert buffer is not None and buffer.shape == ours.decoder.output_projection.weight.shape
    loss.backward()
    weight = ours.decoder.output_projection.weight
    assert torch.equal(weight.grad, buffer)  # the lookups' rows were added into it as well
    # the same sums in another order (the buffer adds the lookups' rows and the chunks'
    # products in its own): the bound of test_same_loss_and_gradients_as_stock
    assert_gradients_within_rounding({n: p.grad for n, p in ours.named_parameters()}, want,
                                     case_mass(task, model, sample, "ls0.1"),
                                     rounding_scale(model, sample))


# 16-bit: the paths round differently. The difference starts at the loss's gradients (each
# element rounded once to the format, in another order: <= u relative) and goes through the same
# backward ops, each rounding again (<= u relative each, about 3 per layer); with 1+1 layers that
# bounds the norm of the whole gradient's difference by about (1 + 3 x 2) u = 7u relative. (Per
# tensor it does not: some gradients are rounding noise around 0, e.g. the key projection's bias,
# whose exact gradient is 0 because softmax ignores a constant added to every key.)
UNIT_ROUNDOFF = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}


@pytest.mark.parametrize("dtype,hint", [(torch.bfloat16, None), (torch.float16, 128.0),
                                        (torch.float16, None)])
def test_16_bit_loss_and_gradients_match_stock(small, dtype, hint):
    """bf16; fp16 with loss scaling (128): with the trainer's hint the stored gradients are
    pre-scaled, without it (fairseq's own trainer) they are float32."""
    task, model, sample = small
    model16 = copy.deepcopy(model).to(dtype)
    scale = 128.0 if dtype == torch.float16 else 1.0
    results = []
    for criterion in (LabelSmoothedCrossEntropyCriterion(task, False, 0.1),
                      LabelSmoothedCrossEntropyChunkedCriterion(task, False, 0.1,
                                                                loss_chunk_tokens=7)):
        criterion.loss_scale = hint
        model16.zero_grad(set_to_none=True)
        loss, _, log = criterion(model16, sample)
        (loss * scale).backward()
        results.append((log, torch.cat([p.grad.float().flatten() / scale
                                        for p in model16.parameters()])))
    (want_log, want), (got_log, got) = results
    # the losses: float32 sums of the same float32 per-token terms, in another order
    assert float(got_log["loss"]) == pytest.approx(float(want_log["loss"]), rel=1e-5)
    assert float(got_log["nll_loss"]) == pytest.approx(float(want_log["nll_loss"]), rel=1e-5)
    assert (got - want).norm() <= 8 * UNIT_ROUNDOFF[dtype] * want.norm()


@pytest.mark.parametrize("dtype,hint", [(torch.float32, None), (torch.bfloat16, None),
                                        (torch.float16, 128.0), (torch.float16, None)])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_logits_widened_a_block_of_rows_at_a_time_give_the_same_bits(dtype, hint, eps):
    """fused_pass widens FLOAT_ELEMENTS logits at a time to float32 (a block of a chunk's
    rows); each row's float32 operations are the same as over the whole chunk at once, so the
    loss sums, accuracy and both gradients are the same bits. One thread: with fewer rows than
    threads torch may split a long row's reduction between threads (a reassociation, which the
    comparisons with the stock criterion above bound)."""
    g = torch.Generator().manual_seed(5)
    vocab, dim, tokens = 1000, 16, 20
    features = (torch.randn(tokens, dim, generator=g) * 2).to(dtype)
    weight = (torch.randn(vocab, dim, generator=g) * 2).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = [fused_pass(features, weight, target, eps=eps, chunk_tokens=7, accuracy=True,
                              grad_scale=hint, need_features_grad=True, need_weight_grad=True,
                              float_elements=elements)
                   for elements in (3 * vocab, 10 ** 9)]  # blocks of 3 rows; chunks whole
    finally:
        torch.set_num_threads(threads)
    (sums, correct, grad_features, grad_weight), whole = results
    assert float_rows(vocab, 3 * vocab) == 3 and float_rows(vocab, 10 ** 9) > 7
    assert torch.equal(sums, whole[0]) and torch.equal(correct, whole[1])
    for got, want in ((grad_features, whole[2]), (grad_weight, whole[3])):
        assert got.dtype == want.dtype and torch.equal(got, want)


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


@pytest.mark.slow
def test_peak_memory_at_nllb_vocabulary():
    # 4 chunks of 64 tokens: the fused loss holds one at a time, the stock criterion the whole
    # batch's logits and their gradient at once (twice the tokens double its work, not the claim)
    tokens, dim, chunk = 256, 32, 64
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
    # The fused loss's own bound, as the estimator counts it (chunk_bytes): besides the model's
    # parameters P and one vocabulary x dim gradient of the tied weight (its buffer in forward;
    # in backward the embedding's own dense gradient, which the stock path holds too: at most a
    # second P), ONE chunk of float32 logits is alive. Everything else is tokens x dim or
    # tokens-long (features, their gradient, per-token statistics: under 1 MiB here, against a
    # 62.5 MiB chunk), and a quarter chunk bounds it. A chunk's logits kept alive while the
    # next chunk's are computed (a view left bound: 2d1f9ac, +251 MiB per rank at NLLB-600M's
    # dim 256) adds a whole chunk and fails here.
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    one_chunk = chunk_bytes(chunk, NLLB_VOCAB, 4, 4)
    bound = 2 * params + one_chunk + one_chunk // 4
    assert chunked <= bound, (f"{report}; bound {bound / 2**20:.0f} MiB: parameters "
                              f"{params / 2**20:.0f} MiB twice and one {one_chunk / 2**20:.1f} MiB "
                              "chunk of logits")


# -- 3. FSDP2 through fairseq-train ----------------------------------------------------------
# One shared set of real 2-rank runs (tied embedding in a grouped unit, --min-params-to-wrap 1).
# Per configuration: the stock path (stock criterion, --fsdp2-no-tied-grad-buffer) and some of:
# the stock criterion with the tied-gradient buffer (now the default), the fused chunked
# criterion with it, the fused criterion without it.
# Each run counts update 2's all-gathers per unit (tests/probes/count_all_gathers.py: through
# the plugin's gloo all-gather, wrapped for that update).

FSDP2_CONFIGS = {  # configuration: (its flags, the variants run besides "stock")
    "fp32, root default, update-freq 2, activation checkpointing":
        (["--update-freq", "2", "--checkpoint-activations"], ["buffer", "fused"]),
    # 16-bit: the buffer with the fused loss (the recipe's setting); the buffer alone is the
    # same code path, shown equal with the stock criterion in fp32 above (a run each saved).
    # The fused loss without the buffer rides along with the root resharded (fp32 has the
    # same code path, and the tolerance below covers bf16's roundings)
    "bf16, root always": (["--bf16", "--fsdp2-root-reshard", "always"],
                          ["fused", "fused, no buffer"]),
    "fp16, root default": (["--fp16"], ["fused"]),
}
STOCK = ["--criterion", "label_smoothed_cross_entropy", "--fsdp2-no-tied-grad-buffer"]
VARIANTS = {
    "stock": STOCK,
    "buffer": ["--criterion", "label_smoothed_cross_entropy"],
    "fused": ["--criterion", "label_smoothed_cross_entropy_chunked", "--loss-chunk-tokens", "64"],
    "fused, no buffer": ["--criterion", "label_smoothed_cross_entropy_chunked",
                         "--loss-chunk-tokens", "64", "--fsdp2-no-tied-grad-buffer"],
}
MAX_TOKENS, CHUNK = 500, 64


def fsdp2_train_args(data: Path, save_dir: Path, *extra: str) -> list[str]:
    return [
        str(data), "--save-dir", str(save_dir), "--user-dir", str(ROOT / "fairseq_fsdp2"),
        "--task", "translation", "--arch", "transformer", "--share-all-embeddings",
        "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", str(MAX_TOKENS),
        "--max-update", "2", "--log-format", "json", "--log-interval", "1", "--seed", "1",
        "--cpu", "--no-progress-bar", "--no-save", "--disable-validation",
        "--ddp-backend", "fsdp2", "--min-params-to-wrap", "1",
        # the batches read in the rank's process (fairseq's default worker's order, every run
        # alike): no data-loader process per rank
        "--num-workers", "0", "--label-smoothing", "0.1", "--report-accuracy", *extra]


def all_gathers(output: str) -> dict[str, int]:
    line = next(l for l in output.splitlines() if "all-gathers of update 2: " in l)
    return json.loads(line.split("all-gathers of update 2: ", 1)[1])


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory, corpus) -> dict:
    from launcher import ok, run_ranks, train_inner

    out = {}
    for config, (flags, variants) in FSDP2_CONFIGS.items():
        for variant in ["stock", *variants]:
            args = fsdp2_train_args(corpus, tmp_path_factory.mktemp("run"), *flags,
                                    *VARIANTS[variant])
            output = ok(run_ranks(2, lambda rank: args, timeout=240, module="count_all_gathers",
                                  env={"PYTHONPATH": str(ROOT / "tests" / "probes")}))
            records = train_inner(output)
            assert len(records) == 2, output[-3000:]
            out[config, variant] = (records, all_gathers(output))
    return out


def tolerance(config: str) -> float:
    """Relative tolerance for gradient norms. In fp32 the paths differ by summation order only:
    the logged 3 decimals decide. In 16-bit the tied weight's gradient is a sum of up to
    chunks + 2 contributions (the chunks, the two lookups) rounded to the format in another
    order, each rounding off by at most u (bf16: 2^-8, fp16: 2^-11) relative; the norm of a
    gradient perturbed by at most e relative per element is off by at most e relative."""
    chunks = -(-MAX_TOKENS // CHUNK)
    u = 2 ** -8 if "bf16" in config else 2 ** -11 if "fp16" in config else 0.0
    return (chunks + 2) * u


@pytest.mark.slow
@pytest.mark.parametrize("config", list(FSDP2_CONFIGS))
def test_fsdp2_fused_loss_and_tied_buffer_match_the_stock_path(fsdp2_runs, config):
    stock, _ = fsdp2_runs[config, "stock"]
    for variant in ("buffer", "fused", "fused, no buffer"):
        if (config, variant) not in fsdp2_runs:
            continue
        run, _ = fsdp2_runs[config, variant]
        for update, (got, want) in enumerate(zip(run, stock), 1):
            for key in ("loss", "nll_loss"):  # logged with 3 decimals: one step of the last
                assert abs(float(got[key]) - float(want[key])) <= 1.01e-3, (variant, key, run,
                                                                            stock)
            assert float(got["gnorm"]) == pytest.approx(
                float(want["gnorm"]), rel=tolerance(config), abs=1.01e-3), (variant, run, stock)
        # update 1 runs the same weights: the same argmax (n_correct / total) per token
        assert run[0]["accuracy"] == stock[0]["accuracy"], (variant, run[0], stock[0])


def shared_unit(counts: dict[str, int]) -> str:
    return next(k for k in counts if "embed_tokens" in k)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(FSDP2_CONFIGS))
def test_fsdp2_fused_loss_gathers_the_embedding_as_often_as_the_stock_loss(fsdp2_runs, config):
    """The fused loss needs the weight in forward only: no extra all-gather of the shared
    unit in backward (the recomputing chunked loss had one more per step)."""
    _, stock = fsdp2_runs[config, "stock"]
    micro = 2 if "update-freq 2" in config else 1
    per_batch = 2 if "always" in config else 1  # gathered again in backward / kept gathered
    assert stock[shared_unit(stock)] == micro * per_batch, stock
    for variant in ("buffer", "fused", "fused, no buffer"):
        if (config, variant) in fsdp2_runs:
            _, counts = fsdp2_runs[config, variant]
            assert counts == stock, (variant, counts, stock)
