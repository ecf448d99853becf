"""The memory estimator (python -m fairseq_fsdp2.estimate) on its own, and the memory plot
(tests/test_estimate.py validates it against real runs):
1. the NLLB sizes at 1 to 64 ranks without allocating, uneven shards as rank classes, HSDP,
   legacy_ddp, the chunked loss, 16- and 8-bit moments, the reduce dtype, the EMA, the command
   line, and the meta-device activation trace against a real CPU forward;
2. the plot command.
"""
from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from launcher import run_command

from fairseq_fsdp2 import estimate as cli
from fairseq_fsdp2.errors import OptionError
from fairseq_fsdp2.estimator import from_args
from fairseq_fsdp2 import plot_memory
from fairseq_fsdp2.estimator.fsdp2_step import simulate_fsdp2
from fairseq_fsdp2.optimizer.adam_stats import BUCKET_MIN
from fairseq_fsdp2.estimator.ledger import CATEGORIES, unit_sizes
from fairseq_fsdp2.estimator import model_profile
from fairseq_fsdp2.estimator.model_profile import resolve, trace_forward, workload_for
from fairseq_fsdp2.estimator.peak import cpu_baseline_bytes, estimate
from fairseq_fsdp2.memory.charts import per_rank_series, read_memory_log

GIB = 1024 ** 3
NLLB_VOCAB = 256_206



# -- 1. the estimator on its own -------------------------------------------------------------

def nllb_args(arch: str, *extra: str) -> list[str]:
    return ["unused-data", "--task", "translation", "--vocab-size", str(NLLB_VOCAB),
            "--arch", arch, "--max-tokens", "4096", "--ddp-backend", "fsdp2",
            "--min-params-to-wrap", "1", "--optimizer", "adam", *extra]


NLLB_PARAMS = {"transformer_nllb_600m": 615_073_792, "transformer_nllb_1_3b": 1_370_638_336,
               "transformer_nllb_3_3b": 3_344_863_232}


@pytest.fixture(scope="module")
def models():
    """The module's meta models and profiles, each made once (from_args.ModelCache, as one
    estimate command or one run of the doc tables shares them): NLLB's 256,206-word dictionary
    made once, not for every estimate."""
    cache = from_args.ModelCache()
    yield cache
    cache.models.clear()
    cache.profiles.clear()
    cache.dictionaries.clear()


def resident_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2 ** 20


@pytest.mark.parametrize("arch", list(NLLB_PARAMS))
def test_nllb_sizes_1_to_64_ranks_without_allocating(arch, models):
    before = resident_gib()
    default, always = (
        cli.estimate_args(nllb_args(arch, "--fp16", "--fsdp2-root-reshard", rr,
                                    "--world-size", "1", "2", "8", "64"), models)
        for rr in ("default", "always"))
    params = NLLB_PARAMS[arch]
    assert resident_gib() - before < 0.5  # the model alone would be params x 4 bytes
    peaks = [e.peak for e in default]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    for e_default, e_always in zip(default, always):
        w = e_default.setup.world_size
        top = e_default.classes[0].breakdown
        assert e_default.setup.device == "cuda" and top["other"] < 0.1 * GIB  # no CPU baseline
        # fp32 master shards: params x 4 / w, and rank 0 holds the rounded-up rows
        assert params * 4 / w <= top["sharded"] <= params * 4 / w * 1.002
        assert top["optim"] == 2 * top["sharded"]  # adam: two fp32 states per parameter
        # at 4096 tokens the stock loss's tokens x 256,206 tensors dominate, in both settings
        assert top["loss"] >= 3 * 4096 * NLLB_VOCAB * 4
        # resharding the root and the embedding can only lower the peak
        assert e_always.peak <= e_default.peak
    # at the loss peak, `default` keeps the fp16 embedding gathered, `always` does not
    dim = 2048 if arch == "transformer_nllb_3_3b" else 1024
    assert default[-1].classes[0].breakdown["gathered"] >= NLLB_VOCAB * dim * 2
    assert always[-1].classes[0].breakdown["gathered"] < NLLB_VOCAB * dim * 2


def test_tied_gradient_buffer_keeps_one_embedding_gradient(models):
    """The tied-gradient buffer (default): the fused loss's weight gradient and the two lookups'
    rows add into one vocab x dim buffer; without it each lookup's backward makes a dense
    vocab x dim gradient that autograd then adds to the loss's (two at once). Reduced early
    (the default with the buffer; --fsdp2-no-tied-early-reduce off): the buffer lives only
    from the loss's forward to the start of backward."""
    flags = ["--criterion", "label_smoothed_cross_entropy_chunked", "--loss-chunk-tokens",
             "512", "--fsdp2-root-reshard", "always"]
    # one profile: the buffer and the early reduce are the Setup's (from_args.setup_for), which
    # simulate_fsdp2 plays over the model's profile (profile_for reads neither)
    profile = models.profile(from_args.parse(nllb_args("transformer_nllb_600m", *flags)))
    ledgers = []
    for extra in (["--fsdp2-no-tied-grad-buffer"], ["--fsdp2-no-tied-early-reduce"], []):
        args = from_args.parse(nllb_args("transformer_nllb_600m", *flags, *extra))
        setup = from_args.setup_for(args, 2)
        assert setup.tied_grad_buffer == (extra != ["--fsdp2-no-tied-grad-buffer"])
        assert setup.tied_early_reduce == (not extra)
        ledgers.append(simulate_fsdp2(profile, setup))
    stock, buffered, early = ledgers
    one = NLLB_VOCAB * 1024 * 4  # one fp32 vocab x dim gradient
    saved = stock.max["grads"] - buffered.max["grads"]
    # Without the buffer the most gradient memory is at the embedding's backward: two dense
    # vocab x dim gradients. With it, one, and the maximum moves to the shared unit's
    # reduce-scatter, where that gradient and the reduce-scatter's output (this rank's half
    # of it, 2 ranks) are alive together: one gradient less, plus that half. The two maxima
    # fall at different moments of backward, where a layer's unsharded gradient (the largest,
    # a decoder layer: 16.8M fp32 parameters) may or may not be alive.
    assert abs(saved - (one - one // 2)) <= 16.8e6 * 4, (saved, one)
    # Reduced early, the most gradient memory is at the loss's backward, before any other
    # gradient exists: the dense gradient and this rank's half of it (fp32: no cast), exactly;
    # less than the buffer's maximum, which adds the other units' shards made by then.
    assert early.max["grads"] == one + one // 2, (early.max["grads"], one)
    assert early.max["grads"] < buffered.max["grads"]


def test_uneven_shards_make_rank_classes_and_hsdp_shards_within_groups(models):
    (eight,) = cli.estimate_args(nllb_args("transformer_nllb_600m", "--world-size", "8"), models)
    # 256,206 rows over 8 ranks: 32,026 on ranks 0-6, 32,024 on rank 7
    assert [c.ranks for c in eight.classes] == [[0, 1, 2, 3, 4, 5, 6], [7]]
    diff = eight.classes[0].breakdown["sharded"] - eight.classes[1].breakdown["sharded"]
    assert diff == 2 * 1024 * 4
    (hsdp,) = cli.estimate_args(nllb_args("transformer_nllb_600m", "--world-size", "8",
                                          "--replicate-degree", "2"), models)
    (four,) = cli.estimate_args(nllb_args("transformer_nllb_600m", "--world-size", "4"), models)
    assert hsdp.classes[0].breakdown["sharded"] == four.classes[0].breakdown["sharded"]
    assert hsdp.peak == four.peak
    assert sorted(r for c in hsdp.classes for r in c.ranks) == list(range(8))


def test_legacy_ddp_and_chunked_loss(models):
    small = ["--arch", "transformer_nllb_tiny", "--encoder-embed-dim", "128",
             "--decoder-embed-dim", "128", "--max-tokens", "1024", "--cpu"]
    base = ["unused-data", "--task", "translation", "--vocab-size", str(NLLB_VOCAB), *small]
    one, two = cli.estimate_args(base + ["--ddp-backend", "legacy_ddp",
                                         "--world-size", "1", "2"], models)
    params = sum(p.numel() for p in models.model(from_args.parse(base)).parameters())
    # every rank holds the model; from 2 ranks, also fairseq's model-sized all-reduce buffer
    assert two.classes[0].breakdown["comm"] == params * 4
    assert two.peak - one.peak == params * 4
    assert one.classes[0].breakdown["gathered"] == params * 4
    (fsdp,) = cli.estimate_args(base + ["--ddp-backend", "fsdp2", "--min-params-to-wrap", "1",
                                        "--fsdp2-root-reshard", "always", "--world-size", "2"],
                                models)
    (chunked,) = cli.estimate_args(base + [
        "--ddp-backend", "fsdp2", "--min-params-to-wrap", "1", "--fsdp2-root-reshard", "always",
        "--criterion", "label_smoothed_cross_entropy_chunked", "--loss-chunk-tokens", "64",
        "--world-size", "2"], models)
    assert fsdp.classes[0].moment == "loss backward: log-softmax gradient"
    assert fsdp.classes[0].breakdown["loss"] == 3 * 1024 * NLLB_VOCAB * 4
    assert chunked.classes[0].breakdown["loss"] <= 64 * NLLB_VOCAB * 4 * 3 + 1024 * 128 * 4
    assert chunked.peak < 0.6 * fsdp.peak
    # CPU: the runtime baseline (with NLLB's dictionaries) is part of every figure
    assert one.classes[0].breakdown["other"] >= cpu_baseline_bytes(NLLB_VOCAB)
    assert cpu_baseline_bytes(NLLB_VOCAB) > cpu_baseline_bytes(100)


def test_16_bit_adam_moments_halve_the_optimizer_state(models):
    """--fp16-adam-stats (and --bf16-adam-stats on FSDP2): two 2-byte moments per parameter
    element instead of two 4-byte ones; during the optimizer step, the largest shard's moments
    are float32 as well (optimizer/adam_stats.py steps one parameter at a time). Stock
    legacy_ddp keeps fp16 moments with --fp16-adam-stats (FusedAdamV1 on GPUs); the plugin's
    --bf16-adam-stats is FSDP2-only (training refuses it there; the estimate counts fp32)."""
    base = nllb_args("transformer_nllb_tiny")

    def setup(*flags, world=2):
        return from_args.setup_for(from_args.parse(base + list(flags)), world)
    profile = models.profile(from_args.parse(base + ["--fp16"]))  # fp16 and bf16 alike
    fp32 = estimate(profile, setup("--fp16"))
    full = fp32.classes[0].breakdown
    for flags, stats in ((["--fp16", "--fp16-adam-stats"], "fp16"),
                         (["--bf16", "--bf16-adam-stats"], "bf16")):
        assert setup(*flags).adam_stats == stats
        est = estimate(profile, setup(*flags))
        half = est.classes[0].breakdown
        assert half["optim"] * 2 == full["optim"] == 2 * full["sharded"]
        assert half["sharded"] == full["sharded"]
        assert 0 < fp32.peak - est.peak <= full["optim"] // 2  # the peak falls by that at most
        assert f"adam ({stats} moments)" in est.table()
    led = simulate_fsdp2(profile, setup("--fp16", "--fp16-adam-stats"))
    largest = max(unit_sizes(u, 2, 0)[2] for u in profile.units)
    # at the optimizer step, on top of the state (2 x 2 bytes per element: the float32 shards'
    # bytes): a bucket of moments in float32, 8 bytes per element of the largest shard (or of
    # the smallest bucket, or all there are); for the largest, its float32 moments less their
    # released fp16 copies and Adam's float32 denominator: 4 + 2 x (4 - 2)
    assert largest > BUCKET_MIN  # the embedding's shard sets it here
    assert led.max["optim"] == led.max["sharded"] + 8 * largest
    ddp = ["--ddp-backend", "legacy_ddp"]
    stock, stock16 = (estimate(profile, setup(*ddp, *flags, world=1)).classes[0].breakdown
                      for flags in (["--fp16"], ["--fp16", "--fp16-adam-stats"]))
    assert stock16["optim"] * 2 == stock["optim"]
    assert setup(*ddp, "--bf16", "--bf16-adam-stats", world=1).adam_stats == "fp32"


#: NLLB-3.3B's settings in docs/memory.md's 2-GPU prose (the chunked loss, the root resharded,
#: activations checkpointed), FSDP2 reducing the tied embedding: the two tests below estimate
#: it under several reduction settings over one profile
NLLB_3_3B_MEMORY_MD = ("--criterion", "label_smoothed_cross_entropy_chunked",
                       "--loss-chunk-tokens", "256", "--fsdp2-root-reshard", "always",
                       "--checkpoint-activations", "--fsdp2-no-tied-early-reduce")


def test_16_bit_reduce_dtype_halves_the_reduce_scatter_input(capsys, models):
    """--fsdp2-reduce-dtype fp16 (with --fp16) or bf16 (with --bf16): FSDP2's reduce-scatter
    input holds 2 bytes per element instead of 4, and so does its output, which FSDP2 then
    casts to the fp32 sharded gradient (_to_dtype_if_needed: both alive at the cast; FSDP2's
    default, --fsdp2-fp32-grad-shards; the trainer's own default keeps the 16-bit output:
    test_16_bit_gradient_shards_and_the_row_chunked_step below). NLLB-3.3B
    with docs/memory.md's 2-GPU settings: the peak stays at the shared embedding's
    reduce-scatter, where the input halves (1.96 -> 0.98 GiB) and the output's 16-bit copy
    (this rank's half of the embedding, 0.49 GiB) comes on top: 0.49 GiB less, not the 0.98 of
    the input alone. Stock legacy_ddp has no such setting (counted fp32), and a reduce dtype
    other than fp32 or the compute dtype is refused, as in training."""
    base = nllb_args("transformer_nllb_3_3b", *NLLB_3_3B_MEMORY_MD)
    profile = models.profile(from_args.parse(base + ["--fp16"]))  # fp16 and bf16 alike
    shared = next(u for u in profile.units if set(profile.output_paths) & set(u.module_paths))
    local, padded, _ = unit_sizes(shared, 2, 0)
    for precision in ("fp16", "bf16"):
        flags = [f"--{precision}", f"--{precision}-adam-stats", "--fsdp2-fp32-grad-shards"]
        default, reduced = (
            estimate(profile, from_args.setup_for(from_args.parse(
                base + flags + ["--fsdp2-reduce-dtype", reduce]), 2))
            for reduce in ("fp32", precision))
        assert reduced.setup.reduce_dtype == precision and default.setup.reduce_dtype == "fp32"
        before, after = default.classes[0], reduced.classes[0]
        assert before.moment == after.moment == f"backward: reduce-scatter {shared.name}"
        assert before.breakdown["comm"] == padded * 4 and after.breakdown["comm"] == padded * 2
        assert after.breakdown["grads"] - before.breakdown["grads"] == local * 2
        assert default.peak - reduced.peak == padded * 2 - local * 2
        assert 0.45 * GIB < default.peak - reduced.peak < 0.5 * GIB
    ddp = from_args.setup_for(from_args.parse(
        base + ["--fp16", "--ddp-backend", "legacy_ddp", "--fsdp2-reduce-dtype", "fp16"]), 1)
    assert ddp.reduce_dtype == "fp32"
    with pytest.raises(OptionError) as refused:  # the library raises; the command prints
        from_args.setup_for(from_args.parse(base + ["--fp16", "--fsdp2-reduce-dtype", "bf16"]), 2)
    assert str(refused.value) == (
        "--fsdp2-reduce-dtype bf16 needs --bf16: gradients are reduced in fp32 or in the "
        "compute dtype, here fp16")  # the command's line: test_cli_with_missing_data_is_one_line




def test_8_bit_adam_moments_take_a_byte_per_element_and_a_float32_per_block(models):
    """--eight-bit-adam-stats on NLLB's tiny architecture (vocabulary 256206): the weights'
    moments a byte per element and 4 bytes per block of 256 in a row, the biases' and norms'
    float32 (rows of 2 ranks' shards: their sum over the ranks is the whole); at the optimizer
    step, one chunk of rows (STEP_CHUNK elements, less than the embedding's shard) stepped at a
    time: its moments in float32 (8 bytes per element), and Adam's denominator or the
    quantization's temporaries, the larger (row_chunk_step.py). Another
    backend refuses the flag (training): the estimate counts fp32 there."""
    from fairseq_fsdp2.optimizer.moments.blockwise_8bit import (CHUNK, TEMPORARY_BYTES,
                                                                quantizable)
    from fairseq_fsdp2.optimizer.row_chunk_step import STEP_CHUNK
    base = nllb_args("transformer_nllb_tiny")
    args = from_args.parse(base + ["--eight-bit-adam-stats"])
    setups = [from_args.setup_for(args, 2), from_args.setup_for(from_args.parse(base), 2)]
    assert [s.adam_stats for s in setups] == ["8bit", "fp32"]
    profile = models.profile(args)
    shapes = [shape for u in profile.units for shape in u.shapes]
    want = sum(2 * (math.prod(s) + 4 * s[0] * -(-math.prod(s[1:]) // 256)) if quantizable(s)
               else 8 * math.prod(s) for s in shapes)
    est, fp32 = (estimate(profile, s) for s in setups)
    per_rank = {r: c.breakdown for c in est.classes for r in c.ranks}
    assert per_rank[0]["optim"] + per_rank[1]["optim"] == want
    full = {r: c.breakdown for c in fp32.classes for r in c.ranks}
    assert full[0]["optim"] / 4 < per_rank[0]["optim"] < 0.27 * full[0]["optim"]
    assert "adam (8bit moments)" in est.table()
    led = simulate_fsdp2(profile, setups[0])
    largest = max(unit_sizes(u, 2, 0)[2] for u in profile.units)
    assert largest > BUCKET_MIN  # the embedding's shard sets it here
    assert led.max["optim"] == per_rank[0]["optim"] + 8 * STEP_CHUNK + max(
        4 * STEP_CHUNK, TEMPORARY_BYTES * CHUNK)
    ddp = from_args.parse(base + ["--eight-bit-adam-stats", "--ddp-backend", "legacy_ddp"])
    assert from_args.setup_for(ddp, 1).adam_stats == "fp32"


def test_16_bit_gradient_shards_and_the_row_chunked_step(models):
    """--fsdp2-reduce-dtype fp16 with Adam (float32 or 8-bit moments): the trainer keeps the
    reduce-scatter's 16-bit output as the sharded gradient (sharding/sixteen_bit_grads.py), 2 bytes
    per element where FSDP2's cast made 4 (--fsdp2-fp32-grad-shards), and Adam steps a chunk of
    rows at a time, its 16-bit gradient widened a chunk at a time (row_chunk_step.py).
    NLLB-3.3B with the recipe's settings on 2 GPUs: at the tied embedding's reduce-scatter
    (the peak either way) the other units' shards are half as large and the embedding's own
    16-bit shard is not cast; the step's temporaries are one chunk's, not the embedding
    shard's. Not with fp16 moments (their scale needs the whole tensor), --update-freq 2
    (gradients added over micro-batches would round in 16 bits), --cpu-offload."""
    from fairseq_fsdp2.optimizer.moments.blockwise_8bit import CHUNK, TEMPORARY_BYTES
    from fairseq_fsdp2.optimizer.row_chunk_step import STEP_CHUNK
    base = nllb_args("transformer_nllb_3_3b", *NLLB_3_3B_MEMORY_MD, "--fp16",
                     "--fsdp2-reduce-dtype", "fp16")
    # the reduce dtype is the Setup's: the profile test_16_bit_reduce_dtype_halves_the_reduce_
    # scatter_input made (the module's ModelCache)
    profile = models.profile(from_args.parse(nllb_args("transformer_nllb_3_3b",
                                                       *NLLB_3_3B_MEMORY_MD, "--fp16")))
    shared = next(u for u in profile.units if set(profile.output_paths) & set(u.module_paths))
    local = unit_sizes(shared, 2, 0)[0]
    for stats in ([], ["--eight-bit-adam-stats"]):
        kept_args, wide_args = (from_args.parse(base + stats + extra)
                                for extra in ([], ["--fsdp2-fp32-grad-shards"]))
        kept_setup, wide_setup = (from_args.setup_for(a, 2) for a in (kept_args, wide_args))
        assert kept_setup.narrow_grads and not wide_setup.narrow_grads
        kept, wide = (estimate(profile, s).classes[0] for s in (kept_setup, wide_setup))
        assert kept.moment == wide.moment == f"backward: reduce-scatter {shared.name}"
        # the other units' shards 2 bytes per element less; the embedding's 16-bit output
        # without its fp32 cast (4 bytes)
        elements = kept.breakdown["sharded"] // 4
        assert wide.breakdown["grads"] - kept.breakdown["grads"] == \
            2 * (elements - local) + 4 * local
        assert wide.peak - kept.peak == 2 * (elements - local) + 4 * local
        led = simulate_fsdp2(profile, kept_setup)
        state = kept.breakdown["optim"]
        widened = 4 + (8 if stats else 0)  # the chunk's gradient, and 8-bit moments, widened
        last = max(4 * STEP_CHUNK, TEMPORARY_BYTES * CHUNK if stats else 0)
        assert led.max["optim"] == state + widened * STEP_CHUNK + last
        assert led.max["optim"] - state < 0.2 * GIB  # the embedding's shard: 262M elements
    for flags in (["--fp16-adam-stats"], ["--update-freq", "2"], ["--cpu-offload"]):
        assert not from_args.setup_for(from_args.parse(base + flags), 2).narrow_grads, flags


def test_store_ema_adds_its_copy_of_the_weights(models):
    """--store-ema: FSDP2 keeps the EMA of each rank's shards in the compute dtype (fp32 with
    --ema-fp32); stock fairseq deep-copies the whole (halved) model, plus a float32 copy with
    --ema-fp32 under --fp16. Nothing else changes, and the breakdown shows the EMA only when
    there is one."""
    base = nllb_args("transformer_nllb_tiny")
    profiles = {precision: models.profile(from_args.parse(base + flags))
                for precision, flags in (("fp16", ["--fp16"]), ("fp32", []))}

    def breakdown(*flags, world=2):
        args = from_args.parse(base + list(flags))
        est = estimate(profiles[from_args.precision_of(args)], from_args.setup_for(args, world))
        return est, est.classes[0].breakdown
    ddp = ["--ddp-backend", "legacy_ddp"]
    for flags, world, per_element in ((["--fp16"], 2, 2), (["--fp16", "--ema-fp32"], 2, 4),
                                      ([], 2, 4), ([*ddp, "--fp16"], 1, 2),
                                      ([*ddp, "--fp16", "--ema-fp32"], 1, 2 + 4),
                                      ([*ddp, "--ema-fp32"], 1, 4)):
        plain_est, plain = breakdown(*flags, world=world)
        est, with_ema = breakdown(*flags, "--store-ema", world=world)
        elements = profiles["fp32"].total_params if ddp[1] in flags else plain["sharded"] // 4
        assert with_ema["ema"] == per_element * elements, (flags, with_ema)
        assert plain["ema"] == 0 and {**with_ema, "ema": 0} == plain, flags
        assert est.peak == plain_est.peak + with_ema["ema"]
        assert "EMA (--store-ema)" in est.table() and "EMA" not in plain_est.table()


def test_an_optimizer_it_does_not_model_is_counted_as_adam_and_said(models):
    (adam,) = cli.estimate_args(nllb_args("transformer_nllb_tiny"), models)
    (other,) = cli.estimate_args(nllb_args("transformer_nllb_tiny", "--optimizer", "adafactor"),
                                 models)
    assert other.classes[0].breakdown["optim"] == adam.classes[0].breakdown["optim"] > 0
    assert not any("not modelled" in n for n in adam.notes)
    assert "optimizer adafactor: its state is not modelled; counted as Adam's" in \
        "\n".join(other.notes)


def test_layerdrop_is_planned_for_an_update_that_drops_no_layer(models):
    """--encoder/--decoder-layerdrop skip random layers in training: the peak to plan for is an
    update that runs them all (the trace ran train mode, where p = 1 skipped every layer)."""
    (plain,) = cli.estimate_args(nllb_args("transformer_nllb_tiny"), models)
    (dropping,) = cli.estimate_args(nllb_args("transformer_nllb_tiny", "--encoder-layerdrop", "1",
                                              "--decoder-layerdrop", "1"), models)
    assert dropping.peak == plain.peak and dropping.classes[0].breakdown == \
        plain.classes[0].breakdown


def test_cli_prints_the_breakdown(capsys):
    assert cli.main(nllb_args("transformer_nllb_600m", "--fp16", "--world-size", "8")) == 0
    out = capsys.readouterr().out
    for key, label in CATEGORIES:
        assert (label in out) == (key != "ema")  # the EMA's row: with --store-ema only
    assert "ranks 0-6" in out and "rank 7" in out and "peak per rank (GiB)" in out
    assert "fsdp2 x 8" in out and "fp16" in out and "CUDA" in out
    assert cli.main(nllb_args("transformer_nllb_600m", "--world-size", "1", "64")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].split()[0] == "1" and lines[4].split()[0] == "64"


def test_cli_with_missing_data_is_one_line(tmp_path, capsys):
    """DATA without fairseq-preprocess's dictionaries (and no --vocab-size): one line naming
    what is missing and the two ways out, no traceback, exit status 2."""
    assert cli.main([str(tmp_path / "absent"), "--task", "translation",
                     "--arch", "transformer_nllb_600m", "--max-tokens", "4096"]) == 2
    message = capsys.readouterr().err.removesuffix("\n")
    assert message.startswith(f"fairseq_fsdp2.estimate: error: data not found: "
                              f"{tmp_path / 'absent'}") and "\n" not in message, message
    assert "--vocab-size V" in message


def saved_bytes_on_cpu(model, batch: int, seq: int) -> int:
    """Bytes of the tensors autograd saves in a real CPU forward (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    tokens = torch.randint(4, 60, (batch, seq))
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, torch.full((batch,), seq), tokens.clone(), features_only=True)
    return sum(seen.values())


def test_meta_trace_counts_what_a_real_forward_saves():
    args = from_args.parse(["unused-data", "--task", "translation", "--vocab-size", "64",
                      "--arch", "transformer_nllb_tiny", "--max-tokens", "168",
                      "--seq-len", "21"])
    torch.manual_seed(0)
    real = from_args.build_task(args).build_model(args)
    meta = from_args.build_meta_model(args)
    workload = workload_for(args.max_tokens, None, args.seq_len)
    assert (workload.batch, workload.tokens) == (8, 168)
    trace = trace_forward(meta, [], workload, torch.float32, features_only=True)
    assert trace.act_bytes == saved_bytes_on_cpu(real, 8, 21) > 0
    # CUDA's fused attention keeps no batch x heads x L x L probabilities: 6 attention calls
    # (2 encoder self, 2 decoder self, 2 cross), each with 4 heads
    cuda = resolve(trace, "cuda")
    assert sum(1 for kind, _ in trace.events if kind == "attn") == 6
    assert trace.act_bytes - cuda.act_bytes >= 6 * 8 * 4 * 21 * 21 * 4


def counting_module_calls(trace):
    """``trace`` (trace_forward), which also returns how many module calls it made."""
    def counted(*args, **kwargs):
        count = [0]
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda *_: count.__setitem__(0, count[0] + 1))
        try:
            return trace(*args, **kwargs), count[0]
        finally:
            hook.remove()
    return counted


@pytest.mark.parametrize("flags", [
    ["--fp16"],
    ["--bf16", "--criterion", "label_smoothed_cross_entropy_chunked", "--loss-chunk-tokens", "64",
     "--checkpoint-activations", "--decoder-layerdrop", "1"],
    ["--fp16", "--lora-rank", "4"],
], ids=["stock loss", "chunked, checkpointed, layerdrop", "lora"])
def test_replayed_layers_trace_as_run_layers(flags, monkeypatch):
    """A layer called as one traced before replays its events instead of running
    (estimator/forward_trace.py): the profile is the one every layer's run gives, event for
    event, with the largest saved tensor of every layer, on the CPU's and CUDA's attention
    (NLLB's architecture with 4 layers a side: the encoder's layers 1-3 and the decoder's layer
    2 replay; the decoder's layer 0 saves the encoder's output, its last layer the attention
    weights: both run; a script compared the 600M, 1.3B and 3.3B sizes so)."""
    args = from_args.parse(["unused-data", "--task", "translation", "--vocab-size", "64",
                            "--arch", "transformer_nllb_tiny", "--encoder-layers", "4",
                            "--decoder-layers", "4", "--max-tokens", "256", "--seq-len", "32",
                            "--ddp-backend", "fsdp2", "--min-params-to-wrap", "1", *flags])
    model = from_args.build_meta_model(args)
    profiles, calls = [], []
    for replay in (True, False):
        def trace(*a, replay=replay, **k):
            traced, count = counting_module_calls(trace_forward)(*a, **k, replay=replay)
            calls.append(count)
            return traced
        monkeypatch.setattr(model_profile, "trace_forward", trace)
        profiles.append(from_args.profile_for(args, model))
    replayed, run = profiles
    for device in ("cpu", "cuda"):
        ours, theirs = replayed.trace_for(device), run.trace_for(device)
        assert ours.events == theirs.events and ours.max_act == theirs.max_act, device
        assert ours.act_bytes == theirs.act_bytes > 0
        assert getattr(ours, "recompute", None) == getattr(theirs, "recompute", None)
    assert any(kind == "enter" and path == "decoder.layers.2" for kind, path in ours.events)
    assert calls[0] < calls[1]  # layers replayed, not run


class SavesLayerInputsAgain(torch.nn.Module):
    """Layers whose inputs the model saves again after them (a weighted sum of every layer's
    input): a replayed layer saves its input as the run one did."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8))
                                          for _ in range(4))
        self.mix = torch.nn.Parameter(torch.ones(4))

    def forward(self, src_tokens, src_lengths, prev_output_tokens, features_only=False):
        x, inputs = self.embed(src_tokens), []
        for layer in self.layers:
            inputs.append(x)
            x = layer(x) + 1  # a new tensor, saved by no operation of the layer
        return x + sum(w * i for w, i in zip(self.mix, inputs))


def test_a_replayed_layer_saves_its_inputs_as_the_run_one():
    with torch.device("meta"):
        model = SavesLayerInputsAgain()
    layers = [f"layers.{i}" for i in range(4)]
    (fast, fewer), (slow, every) = (
        counting_module_calls(trace_forward)(model, layers, workload_for(None, 2, 3),
                                             torch.float32, False, replay=replay)
        for replay in (True, False))
    assert fast.events == slow.events and fast.max_act == slow.max_act
    assert fewer < every  # layers replayed, not run


# -- 2. the plot -----------------------------------------------------------------------------

def test_plot_memory_writes_a_png(tmp_path, capsys):
    log = tmp_path / "memory.jsonl"
    log.write_text("".join(json.dumps({"num_updates": u, "device": "cpu", "ranks": [
        {"rank": 0, "peak_gb": 1.0 + u / 10, "reserved_gb": 0.0, "alloc_retries": 0.0},
        {"rank": 1, "peak_gb": 0.9 + u / 10, "reserved_gb": 0.0, "alloc_retries": 0.0}]})
        + "\n" for u in (2, 4, 6)))
    assert per_rank_series(read_memory_log(log)) == {0: ([2, 4, 6], [1.2, 1.4, 1.6]),
                                                     1: ([2, 4, 6], [1.1, 1.3, 1.5])}
    out = tmp_path / "plots" / "memory.png"
    # the command, a process of its own (forked from the test server: torch imported)
    proc = run_command("fairseq_fsdp2.plot_memory", log, out, "--predicted-gb", "1.5",
                       timeout=120)
    assert proc.returncode == 0, proc.output[-2000:]
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (800, 450) and len(data) > 10_000

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"num_updates": 1}\n')
    assert plot_memory.main([str(bad), str(tmp_path / "bad.png")]) == 2
    assert "not a memory.jsonl record" in capsys.readouterr().err
    assert not (tmp_path / "bad.png").exists()


def test_bf16_weights_halve_the_sharded_parameters(models):
    """--memory-efficient-bf16 with Adam (settings.keeps_bf16_weights): the trained shards in
    bf16, 2 bytes per element where --bf16's fp32 masters take 4, and nothing else kept
    changes where --bf16's gradient shards are bf16 too (--fsdp2-reduce-dtype bf16: both keep
    the reduce-scatter's bf16 output). NLLB-3.3B with the recipe's settings on one GPU, 8-bit
    moments: the peak (the tied embedding's reduce-scatter) is lower by 2 bytes per parameter
    element exactly; at the step the chunk's weight rows are widened too (4 bytes an element
    of a chunk: row_chunk_step.py) and rounded back stochastically (bf16's random integers:
    within the 8-bit quantization's temporaries). With fp32 gradient reduction the bf16
    weights' gradient shards are bf16 (FSDP2 keeps a gradient in its parameter's dtype), the
    fp32 output cast at the reduce-scatter. Not with another optimizer, fp16 moments or
    another backend (fp32 masters, as --bf16)."""
    from fairseq_fsdp2.optimizer.moments.blockwise_8bit import CHUNK, TEMPORARY_BYTES
    from fairseq_fsdp2.optimizer.row_chunk_step import STEP_CHUNK
    base = nllb_args("transformer_nllb_3_3b", "--criterion", "label_smoothed_cross_entropy_chunked",
                     "--loss-chunk-tokens", "256", "--fsdp2-root-reshard", "always",
                     "--checkpoint-activations", "--eight-bit-adam-stats", "--max-tokens", "2048")
    profile = models.profile(from_args.parse(base + ["--bf16"]))
    setups = {name: from_args.setup_for(from_args.parse(base + flags), 1) for name, flags in (
        ("masters", ["--bf16", "--fsdp2-reduce-dtype", "bf16"]),
        ("ours", ["--memory-efficient-bf16", "--fsdp2-reduce-dtype", "bf16"]),
        ("ours, fp32 reduce", ["--memory-efficient-bf16"]))}
    assert [s.bf16_weights for s in setups.values()] == [False, True, True]
    masters, ours, fp32_reduce = (estimate(profile, s).classes[0] for s in setups.values())
    elements = masters.breakdown["sharded"] // 4
    assert ours.breakdown["sharded"] == 2 * elements
    assert ours.moment == masters.moment
    assert {**ours.breakdown, "sharded": 0} == {**masters.breakdown, "sharded": 0}
    assert masters.peak - ours.peak == 2 * elements
    # fp32 reduction: the same bf16 gradient shards; the reduce-scatter's input and output in
    # fp32, the output cast to bf16 beside it
    assert fp32_reduce.peak > ours.peak
    led = simulate_fsdp2(profile, setups["ours"])
    state = ours.breakdown["optim"]
    widened = 4 + 4 + 8  # the chunk's gradient, its weight rows, its 8-bit moments
    assert led.max["optim"] == state + widened * STEP_CHUNK + max(
        4 * STEP_CHUNK, TEMPORARY_BYTES * CHUNK)
    for flags in (["--optimizer", "adafactor"], ["--fp16-adam-stats"],
                  ["--ddp-backend", "legacy_ddp"]):
        args = from_args.parse([a for a in base if a != "--eight-bit-adam-stats"] +
                               ["--memory-efficient-bf16", *flags])
        assert not from_args.setup_for(args, 1).bf16_weights, flags
