"""LoRA fine-tuning (--lora-rank, docs/lora.md): real runs of the tiny model, shared.

One base model (FSDP2, 1 rank, 2 full updates) is what every LoRA run fine-tunes
(--finetune-from-model), from its stock (consolidated) checkpoint: 2 ranks x update-freq 3
(saved at update 4), the 2-rank run resumed at update 4 on 2 ranks (exact) and on 3 ranks x 2
(the same global batch, another reduction order), a --bf16 run training the layer norms in full
too (1 rank); and from its sharded FSDP2 checkpoint: the same global batch on 1 rank x 6 (its
first COMPARED updates). Starting points
from Hugging Face directories: test_hf_nllb.py (through scripts/finetune_nllb.sh) and
test_hf_add_langs.py (with added languages); from a LoRA checkpoint: ``starts`` below.
"""
import copy

import pytest
import torch

import fairseq_fsdp2  # noqa: F401  (allow-lists the classes fairseq pickles for torch.load)

from conftest import PLUGIN, REPO, SHORT_GENERATION, TINY_MODEL, TRAINING
from hf_compare import AMPLIFICATION_GUARD, LOGIT_TOL, fairseq_logits, greedy, greedy_gaps
from launcher import finish_ranks, ok, run_command, run_ranks, start_ranks
from numerics import FP32_REORDERED, U32, per_update, printed_close
from scenarios import FSDP2

from fairseq_fsdp2.checkpoint.export import lora_tensors
from fairseq_fsdp2.models import lora

# no dropout: masks depend on how an update is split over ranks (test_checkpoints.py)
EXACT = ["--dropout", "0", "--max-tokens", "200"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]  # scaling 2: a wrong scaling shows
SCALING = 2.0
UPDATES = 6
#: the 1-rank run's updates, compared with the 2-rank run's: update 1 moves B only (A's gradient
#: is 0 while B = 0), update 2 moves A for the first time, update 3 moves both with Adam moments
#: of earlier updates, whose result update 4's loss and gradient norm show; a 5th and 6th would
#: repeat that (1 rank x update-freq 6: 6 forward-backward passes an update)
COMPARED = 4
RESUMED_FROM = 4  # the 2-rank run's save the resumed runs start from


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")

    def args(save_dir, *extra):
        return [str(corpus), "--user-dir", PLUGIN, *TINY_MODEL, *TRAINING, *FSDP2, *EXACT,
                "--save-dir", str(save_dir), *map(str, extra)]
    ok(run_ranks(1, lambda r: args(root / "base", "--max-update", 2)))
    base = root / "base" / "checkpoint_last_consolidated.pt"
    lora_run = ["--finetune-from-model", base, *LORA, "--max-update", UPDATES]
    out = {"root": root, "base": base, "args": args}
    # saved at update RESUMED_FROM (and at its end), where both adapter matrices and their Adam
    # moments have moved (update 1 moves B only: A's gradient is 0 while B = 0): the resumed
    # runs' first update already uses every restored state; 2 updates each, not 4 from update
    # 2 (5 rank-processes x 2 updates fewer)
    out["two"] = ok(run_ranks(2, lambda r: args(root / "two", *lora_run, "--update-freq", 3,
                                                 "--save-interval-updates", RESUMED_FROM)))
    # from the sharded checkpoint (the same weights as the consolidated one)
    sharded = ["--finetune-from-model", root / "base" / "checkpoint_last.pt", *LORA,
               "--max-update", COMPARED]
    out["one"] = ok(run_ranks(1, lambda r: args(root / "one", *sharded, "--update-freq", 6,
                                                 "--no-save")))
    restore = ["--restore-file", root / "two" / f"checkpoint_1_{RESUMED_FROM}.pt", *LORA,
               "--max-update", UPDATES, "--no-save"]
    out["resumed2"] = ok(run_ranks(2, lambda r: args(root / "r2", *restore, "--update-freq", 3)))
    out["resumed3"] = ok(run_ranks(3, lambda r: args(root / "r3", *restore, "--update-freq", 2)))
    # 1 rank: its tests' claims are what is stored and exported (the frozen base in bf16, the
    # layer norms trained in fp32, the model and its EMA each merged from its own tensors, the
    # PEFT refusal), and the export reads the DCP files whatever the world size
    # (checkpoint/export.py); 2 ranks' shards read back: the fp32 run "two"
    out["bf16"] = ok(run_ranks(1, lambda r: args(
        root / "bf16", "--finetune-from-model", base, *LORA, "--bf16", "--lora-train-params",
        "layer_norm", "--max-update", 2, "--store-ema", "--ema-decay", "0.5")))
    return out


def load_stock(path):
    from fairseq import checkpoint_utils
    (model,), cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)])
    return model.eval(), cfg, task


def python_attention(model):
    """fairseq's Python attention path for every attention module, as LoRA runs it
    (models/lora.py): PyTorch's fused path rounds otherwise."""
    for module in model.modules():
        if hasattr(module, "skip_embed_dim_check"):
            module.skip_embed_dim_check = True
    return model


def adapted(model, tensors=None, seed=1):
    """``model`` with adapters (the runs' settings), holding ``tensors`` (full, by name) or
    the runs' starting adapters."""
    lora.adapt(model, 4, SCALING, 0.0, ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"])
    values = tensors if tensors is not None else lora.initial_adapters(model, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in values:
                param.copy_(values[name].to(param.dtype))
    return model.eval()


def batch(task, sentences=8):
    """Validation sentences whose targets have one length (the decoder input unpadded:
    transformers places padded target positions otherwise than fairseq)."""
    from collections import Counter
    task.load_dataset("valid")
    data = task.dataset("valid")
    length = Counter(len(data[i]["target"]) for i in range(len(data))).most_common(1)[0][0]
    chosen = [i for i in range(len(data)) if len(data[i]["target"]) == length][:sentences]
    samples = data.collater([data[i] for i in chosen])
    net = samples["net_input"]
    return {"src": net["src_tokens"].tolist(), "prev": net["prev_output_tokens"].tolist()}


def test_adapters_start_at_the_base_model_bit_for_bit(runs):
    base, _, task = load_stock(runs["base"])
    python_attention(base)
    request = batch(task)
    want = fairseq_logits(base, request)
    got = fairseq_logits(adapted(copy.deepcopy(base)), request)
    assert torch.equal(got, want)
    # the adapters are there: B = 0 hides A, and a nonzero B shows in the logits
    moved = adapted(copy.deepcopy(base))
    with torch.no_grad():
        moved.encoder.layers[0].fc1.lora_B.fill_(1e-3)
    assert not torch.equal(fairseq_logits(moved, request), want)


def test_only_adapters_train_and_the_frozen_base_stays_bit_for_bit(runs):
    path = runs["root"] / "two" / "checkpoint_last.pt"
    state = torch.load(path, weights_only=True)
    tensors = lora_tensors(str(path), state)
    base = torch.load(runs["base"], weights_only=True)["model"]
    model, _, _ = load_stock(runs["base"])
    start = lora.initial_adapters(adapted(model), 1)
    assert set(tensors) == set(base) | set(start)
    for key, value in base.items():  # fp32 run: the base exactly
        assert torch.equal(tensors[key], value), key
    for key, value in start.items():  # every adapter tensor moved
        assert not torch.equal(tensors[key], value), key
        if key.endswith("lora_B"):
            assert torch.equal(value, torch.zeros_like(value))
    # --bf16 --lora-train-params layer_norm: the frozen base stored in bf16 (no fp32 copy),
    # the layer norms and adapters in fp32, the layer norms trained
    path = runs["root"] / "bf16" / "checkpoint_last.pt"
    tensors = lora_tensors(str(path), torch.load(path, weights_only=True))
    for key, value in base.items():
        if "layer_norm" in key:
            assert tensors[key].dtype == torch.float32, key
            assert not torch.equal(tensors[key], value), key
        elif value.is_floating_point():
            assert tensors[key].dtype == torch.bfloat16, key
            assert torch.equal(tensors[key], value.to(torch.bfloat16)), key
    assert all(tensors[k].dtype == torch.float32 for k in start)
    assert "LoRA rank 4: 32 linear modules adapted, 9,216 adapter parameters" in runs["bf16"]
    assert "768 more trained in full" in runs["bf16"]
    # its export: the model and its EMA (--store-ema) merged, in float32 (the frozen 16-bit
    # tensors widened exactly), no adapters: what stock fairseq reads
    export = torch.load(runs["root"] / "bf16" / "checkpoint_last_consolidated.pt",
                        weights_only=True)
    for weights in (export["model"], export["extra_state"]["ema"]):
        assert set(weights) == set(base)
        assert all(v.dtype == torch.float32 for v in weights.values() if v.is_floating_point())
    for key, value in base.items():  # frozen and not adapted: the base, widened from bf16
        if "layer_norm" not in key and not key.endswith(("proj.weight", "fc1.weight",
                                                         "fc2.weight")) and \
                value.is_floating_point():
            assert torch.equal(export["model"][key], value.to(torch.bfloat16).float()), key


def test_two_ranks_train_as_one_with_the_same_global_batch(runs):
    """Adam from the same weights on the same batches; the 2-rank sums are reduced in another
    order: FP32_REORDERED (tests/numerics.py) on the printed loss and gradient norm."""
    got, want = per_update(runs["two"]), per_update(runs["one"])
    assert sorted(got) == list(range(1, UPDATES + 1))
    assert sorted(want) == list(range(1, COMPARED + 1))
    for n in want:
        for key, a, b in zip(("loss", "gnorm"), got[n], want[n]):
            assert printed_close(a, b, FP32_REORDERED, key), (n, key, a, b)


def test_resume_is_exact_on_two_ranks_and_within_the_bound_on_three(runs):
    full = per_update(runs["two"])
    same, other = per_update(runs["resumed2"]), per_update(runs["resumed3"])
    assert sorted(same) == sorted(other) == list(range(RESUMED_FROM + 1, UPDATES + 1))
    for n in same:
        assert same[n] == full[n], (n, same[n], full[n])  # the same bits, printed alike
        for key, a, b in zip(("loss", "gnorm"), other[n], full[n]):
            assert printed_close(a, b, FP32_REORDERED, key), (n, key, a, b)


def test_a_save_holds_the_adapters_and_their_adam_state_only(runs):
    """12 bytes per adapter parameter (fp32 value and Adam's two fp32 moments) plus scalars
    and buffers; the frozen base once per save dir, in its own directory."""
    import torch.distributed.checkpoint as dcp
    save = runs["root"] / "two"
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    info = state["fsdp2"]
    metadata = dcp.FileSystemReader(str(save / info["shards"])).read_metadata()
    adapters = tensor_bytes = 0
    for key, md in metadata.state_dict_metadata.items():
        if not hasattr(md, "size"):
            continue
        numel = torch.Size(md.size).numel()
        size = numel * md.properties.dtype.itemsize
        if ".lora_" in key:
            adapters += size
        elif numel > 1:
            raise AssertionError(f"a save holds {key} ({tuple(md.size)}), not an adapter's")
        tensor_bytes += size
    assert adapters == 12 * 9216, adapters
    assert tensor_bytes - adapters <= 8 * 200, tensor_bytes  # steps, versions: scalars
    dirs = sorted(p.name for p in (save / "fsdp2_shards").iterdir())
    assert len([d for d in dirs if d.startswith("lora-base-")]) == 1, dirs
    assert info["lora_base"].endswith(dirs[0]), (info, dirs)


def test_merged_export_equals_the_unmerged_model_and_stock_generate_reads_it(runs, corpus):
    """The consolidated export (written at the end of the run) holds W + scaling x B A in
    float32, no adapters. In float64 (tests/hf_compare.py) its logits equal the unmerged
    model's within the effect of rounding each merged weight to float32 once: a relative
    perturbation of U32 per weight, amplified by the forward at most A times, A <= 2^14 as
    the guard checks (the unmerged model's own float32 forward within AMPLIFICATION_GUARD x
    scale of float64), so within AMPLIFICATION_GUARD x scale plus float64's rounding."""
    save = runs["root"] / "two"
    merged_path = save / "checkpoint_last_consolidated.pt"
    merged = torch.load(merged_path, weights_only=True)["model"]
    assert not [k for k in merged if "lora" in k]
    path = save / "checkpoint_last.pt"
    tensors = lora_tensors(str(path), torch.load(path, weights_only=True))
    model, _, task = load_stock(runs["base"])
    unmerged = adapted(python_attention(model), tensors)  # the base's weights too
    request = batch(task)
    exported, _, _ = load_stock(merged_path)
    python_attention(exported)
    u64, u32 = fairseq_logits(copy.deepcopy(unmerged).double(), request), \
        fairseq_logits(unmerged, request)
    m64 = fairseq_logits(copy.deepcopy(exported).double(), request)
    scale = max(1.0, u64.abs().max().item())
    guard = (u32.double() - u64).abs().max().item() / scale
    assert guard <= AMPLIFICATION_GUARD, guard
    worst = (m64 - u64).abs().max().item() / scale
    base, _, _ = load_stock(runs["base"])
    moved = (fairseq_logits(python_attention(base).double(), request) - u64).abs().max().item() \
        / scale
    print(f"merged vs unmerged float64 logits: {worst:.2e} x scale (tolerance "
          f"{AMPLIFICATION_GUARD:.2e}); the adapters moved them by {moved:.2e} x scale; float32 "
          f"vs float64: {guard:.2e}")
    assert worst <= AMPLIFICATION_GUARD + 2.0 ** -40, worst
    assert moved > 10 * AMPLIFICATION_GUARD, moved  # a wrong merge would show
    # Greedy translations (float64) of the merged and the unmerged model: the same tokens,
    # except from a step whose best two logits are within twice that tolerance (there the
    # rounding can choose otherwise, and the rest continues from another context)
    from omegaconf import open_dict
    exported64, unmerged64 = copy.deepcopy(exported).double(), copy.deepcopy(unmerged).double()
    _, cfg, _ = load_stock(merged_path)
    with open_dict(cfg):
        cfg.generation.beam = 1
        cfg.generation.max_len_a, cfg.generation.max_len_b = 0, 16  # the tiny corpus: <= 13
    near_tie = 2 * (AMPLIFICATION_GUARD + 2.0 ** -40) / LOGIT_TOL  # greedy_gaps' units
    data = task.dataset("valid")
    generators = [task.build_generator([m], cfg.generation) for m in (exported64, unmerged64)]
    differ = 0
    for i in range(10):
        src = data[i]["source"].tolist()
        got = greedy(task, generators[0], exported64, src)
        want = greedy(task, generators[1], unmerged64, src)
        k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b),
                 None if len(got) == len(want) else min(len(got), len(want)))
        assert k is None or greedy_gaps(unmerged64, src, want)[k] <= near_tie, (i, got, want)
        differ += k is not None
    print(f"greedy translations of 10 sentences: {differ} differ (at near-ties)")
    # stock fairseq-generate (no --user-dir) reads the merged export; with the plugin it reads
    # the sharded checkpoint merged the same way: the same bits, so the same translations
    def generate(path, *extra):
        proc = run_command("fairseq_cli.generate", corpus, "--path", path, "--gen-subset",
                           "valid", "--beam", "2", "--max-tokens", "2000", "--cpu", *SHORT_GENERATION,
                           *extra)
        assert proc.returncode == 0, proc.output[-2000:]
        return sorted(line.split("\t")[::2] for line in proc.output.splitlines()
                      if line.startswith("H-"))
    stock = generate(merged_path)
    assert len(stock) > 90
    assert generate(path, "--user-dir", PLUGIN) == stock


def test_peft_loads_the_adapter_directory_and_agrees_with_fairseq(runs, tmp_path):
    """The base exported to Hugging Face format (--format hf), the adapters as a PEFT
    directory (--format peft): peft.PeftModel.from_pretrained on transformers' M2M100 gives the
    unmerged fairseq model's float64 logits within LOGIT_TOL x scale (tests/hf_compare.py:
    both sides' float64 forwards, their amplification of rounding guarded)."""
    import json
    import os

    from conftest import FIXTURE_DEPS, TESTS, need_fixture_dep
    from hf_compare import assert_logits_close
    need_fixture_dep("peft", "for the PEFT side")
    path = runs["root"] / "two" / "checkpoint_last.pt"
    hf_base, adapter = tmp_path / "hf_base", tmp_path / "adapter"
    for source, out, fmt in ((runs["base"], hf_base, "hf"), (path, adapter, "peft")):
        proc = run_command("fairseq_fsdp2.consolidate", "--format", fmt, source, out)
        assert proc.returncode == 0, proc.output[-2000:]
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json",
                                                         "adapter_model.safetensors"]
    model, _, task = load_stock(runs["base"])
    tensors = lora_tensors(str(path), torch.load(path, weights_only=True))
    ours = adapted(python_attention(model), tensors)
    request = batch(task)
    (tmp_path / "request.json").write_text(json.dumps(request))
    # its own process with transformers and peft on its path, forked from the test server
    # (torch already imported: ~1.6 CPU-s less than a fresh interpreter)
    done = run_command("peft_reference", hf_base, adapter, tmp_path / "request.json",
                       tmp_path / "result.json", timeout=300,
                       env={"PYTHONPATH": os.pathsep.join(map(str, (FIXTURE_DEPS, TESTS)))})
    assert done.returncode == 0, done.output[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["lora_modules"] == 32 and result["lora_B_abs_sum"] > 0, result
    assert_logits_close(ours, copy.deepcopy(ours).double(), request, result)


# --- the merge, checked weight by weight ------------------------------------------------------

def merged_reference(tensors: dict, scaling: float) -> dict:
    """Every adapted weight's W + scaling x B A in float64, with the product summed term by term
    over the rank here (not lora.merged's matmul), and an upper bound of the error of that sum
    and of lora.merged's: each is a sum of rank + 1 terms, so within (rank + 1) x U64 of the
    sum of their magnitudes (|W| + scaling x |B| |A|)."""
    out = {}
    for key in tensors:
        if not key.endswith(".lora_A"):
            continue
        base = key[:-len(".lora_A")]
        w = tensors[f"{base}.weight"].double()
        a, b = tensors[key].double(), tensors[f"{base}.lora_B"].double()
        product = (b.unsqueeze(2) * a.unsqueeze(0)).sum(1)  # out x rank x in, over the rank
        size = w.abs() + scaling * (b.abs().unsqueeze(2) * a.abs().unsqueeze(0)).sum(1)
        out[f"{base}.weight"] = (w + scaling * product, (a.shape[0] + 1) * 2.0 ** -53 * size)
    return out


def assert_merged(weights: dict, tensors: dict, scaling: float) -> int:
    """``weights`` (an export, float32) holds every adapted weight as W + scaling x B A of the
    checkpoint's ``tensors``, rounded once to float32: within U32 x |exact| of the exact value
    (round to nearest), which the float64 reference and lora.merged's float64 value each
    approach within their bound. Every other floating tensor: the checkpoint's, widened
    exactly. Returns how many weights were adapted."""
    reference = merged_reference(tensors, scaling)
    assert reference
    for key, value in tensors.items():
        if lora.is_adapter(key) or not value.is_floating_point():
            continue
        got = weights[key]
        assert got.dtype == torch.float32, (key, got.dtype)
        if key not in reference:
            assert torch.equal(got, value.float()), key
            continue
        want, error = reference[key]
        worst = ((got.double() - want).abs() - (U32 * (want.abs() + error) + 2 * error)).max()
        assert worst <= 0, (key, worst.item())
    return len(reference)


def test_every_adapted_weight_of_the_merged_export_is_w_plus_scaled_ba(runs):
    """The 2-rank fp32 run's export: all 32 adapted weights, each against the float64 sum of
    the checkpoint's own W, A and B (finding 8: a merge that skips or mis-scales one adapter
    moves the logits by less than their tolerance)."""
    path = runs["root"] / "two" / "checkpoint_last.pt"
    tensors = lora_tensors(str(path), torch.load(path, weights_only=True))
    export = torch.load(runs["root"] / "two" / "checkpoint_last_consolidated.pt",
                        weights_only=True)["model"]
    assert not [k for k in export if lora.is_adapter(k)]
    assert assert_merged(export, tensors, SCALING) == 32
    moved = [k for k, (want, _) in merged_reference(tensors, SCALING).items()
             if not torch.equal(want, tensors[k].double())]
    assert len(moved) == 32  # every adapter trained: a skipped merge shows


def test_the_bf16_export_merges_the_model_and_its_ema_each_from_its_own_tensors(runs):
    """--bf16 --store-ema: the frozen base stored in bf16, the adapters in fp32. The export's
    model and EMA (extra_state["ema"]) each hold W + scaling x B A of their own tensors (the
    EMA's from its own shards), computed from the bf16 W widened (exact), not in bf16 (finding
    7: a merge in bf16, or the model's tensors merged as the EMA, pass a dtype check)."""
    from fairseq_fsdp2.checkpoint.export import EMA_KEY, full_tensors
    path = runs["root"] / "bf16" / "checkpoint_last.pt"
    state = torch.load(path, weights_only=True)
    model = lora_tensors(str(path), state)
    ema = full_tensors(str(path), state, EMA_KEY)
    assert any(v.dtype == torch.bfloat16 for v in model.values())
    export = torch.load(runs["root"] / "bf16" / "checkpoint_last_consolidated.pt",
                        weights_only=True)
    assert assert_merged(export["model"], model, SCALING) == 32
    assert assert_merged(export["extra_state"][EMA_KEY], ema, SCALING) == 32
    # the EMA (decay 0.5 over 2 updates) is not the model: every adapter and layer norm differs
    trained = [k for k in model if lora.is_adapter(k) or "layer_norm" in k]
    assert len(trained) == 64 + 24  # 12 layer norms' weights and biases
    assert all(not torch.equal(ema[k].float(), model[k].float()) for k in trained)


def test_consolidate_hf_of_a_lora_checkpoint_exports_the_merged_model(runs, tmp_path):
    """docs/lora.md: ``consolidate CHECKPOINT OUT --format hf`` of a LoRA checkpoint writes
    the merged model as a Hugging Face directory: every tensor read back by the plugin's own
    reader (fairseq names) is the merged weight, against the float64 reference."""
    from fairseq_fsdp2.consolidate import main as consolidate_main
    from fairseq_fsdp2.hf.nllb_weights import HFWeights
    path = runs["root"] / "two" / "checkpoint_last.pt"
    out = tmp_path / "hf"
    assert consolidate_main([str(path), str(out), "--format", "hf"]) == 0
    weights = HFWeights(str(out))
    tensors = lora_tensors(str(path), torch.load(path, weights_only=True))
    assert set(weights) == {k for k in tensors if not lora.is_adapter(k)}
    assert assert_merged(weights, tensors, SCALING) == 32


def test_peft_export_of_a_run_with_lora_train_params_stops_with_one_line(runs, tmp_path,
                                                                          capfd):
    """docs/lora.md: a checkpoint that trained parameters in full (the --bf16 run's layer
    norms) has no PEFT LoRA form: refused with one line, exit 2, nothing written."""
    from fairseq_fsdp2.consolidate import main as consolidate_main
    out = tmp_path / "adapter"
    code = consolidate_main([str(runs["root"] / "bf16" / "checkpoint_last.pt"), str(out),
                             "--format", "peft"])
    lines = capfd.readouterr().err.splitlines()
    assert code == 2 and not out.exists(), (code, lines)
    assert len(lines) == 1 and lines[0].startswith(
        "fairseq_fsdp2: error: the checkpoint trained ") and \
        "layer_norm" in lines[0] and "(--lora-train-params)" in lines[0], lines


# --- runs that start from these runs' checkpoints ----------------------------------------------

@pytest.fixture(scope="module")
def starts(runs):
    """Three 1-rank runs of 1 update, at once: a full fine-tune from the base whose attention
    takes fairseq's Python path (tests/probes/python_attention.py), as the LoRA run ``one``'s
    does, with the same batches (update-freq 6); and from the 2-rank LoRA run's last
    checkpoint (--finetune-from-model), with lr 0 (the weights stay as loaded): a full
    fine-tune, and LoRA of another rank (2, alpha 2)."""
    root, args = runs["root"], runs["args"]
    lora_ckpt = runs["root"] / "two" / "checkpoint_last.pt"
    procs = {
        "base": start_ranks(1, lambda r: args(
            root / "full_first", "--finetune-from-model", runs["base"], "--max-update", 1,
            "--update-freq", 6, "--no-save"), module="python_attention",
            env={"PYTHONPATH": str(REPO / "tests" / "probes")}),
        "full": start_ranks(1, lambda r: args(
            root / "full_from_lora", "--finetune-from-model", lora_ckpt, "--max-update", 1,
            "--lr", 0)),
        "lora": start_ranks(1, lambda r: args(
            root / "lora_from_lora", "--finetune-from-model", lora_ckpt, "--lora-rank", 2,
            "--lora-alpha", 2, "--max-update", 1, "--lr", 0)),
    }
    return {name: ok(finish_ranks(p, timeout=240)) for name, p in procs.items()}


def test_a_lora_runs_first_loss_is_the_base_models(runs, starts):
    """The adapters start with B = 0, so the LoRA run's first forward is the base model's: each
    adapted linear module adds exactly zero (0 x finite, summed, scaled, added: x + 0 = x) to
    the same float32 F.linear as nn.Linear, and the attention runs the same Python path in
    both runs (the probe), on the same batches (the same seed, data and update-freq 6 on 1
    rank, no dropout), from the same weights (the LoRA run from the sharded checkpoint, the
    full one from its consolidated copy). The same float32 operations on the same values give
    the same bits: the same printed loss and nll_loss, exactly."""
    lora_first, base_first = per_update(runs["one"], ("loss", "nll_loss"))[1], \
        per_update(starts["base"], ("loss", "nll_loss"))[1]
    assert "LoRA" not in starts["base"] and "LoRA rank 4" in runs["one"]
    assert lora_first == base_first, (lora_first, base_first)


def test_finetune_from_a_lora_checkpoint_starts_from_its_merged_weights(runs, starts):
    """docs/lora.md: --finetune-from-model of a LoRA checkpoint takes its weights with the
    adapters merged: into a full fine-tune (lr 0: its export is the weights as loaded), and
    into a LoRA run of another rank, whose frozen base is the merged model and whose adapters
    start afresh (rank 2, B = 0, A from the seed; lr 0 keeps them)."""
    root = runs["root"]
    merged = torch.load(root / "two" / "checkpoint_last_consolidated.pt",
                        weights_only=True)["model"]
    full = torch.load(root / "full_from_lora" / "checkpoint_last_consolidated.pt",
                      weights_only=True)["model"]
    assert set(full) == set(merged)
    assert all(torch.equal(full[k], merged[k]) for k in merged)
    assert "LoRA rank 2: 32 linear modules adapted, 4,608 adapter parameters" in starts["lora"]
    path = root / "lora_from_lora" / "checkpoint_last.pt"
    state = torch.load(path, weights_only=True)
    assert state["fsdp2"]["lora"]["rank"] == 2
    tensors = lora_tensors(str(path), state)
    model, _, _ = load_stock(runs["base"])
    lora.adapt(model, 2, 1.0, 0.0, ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"])
    start = lora.initial_adapters(model, 1)
    assert set(tensors) == set(merged) | set(start)
    for key, value in merged.items():
        assert torch.equal(tensors[key], value), key
    for key, value in start.items():
        assert torch.equal(tensors[key], value), key


def test_the_estimator_counts_a_frozen_16_bit_base_and_the_adapters_state():
    """No run: the estimator's LoRA ledger (estimator/lora.py) on the tiny NLLB at 2 ranks,
    --fp16 --lora-rank 4, against the adapted model's parameters counted here: each rank's
    shards are its dim-0 rows (torch.chunk's split: the first ranks take ceil(n / 2)); the
    frozen ones in 2 bytes, the adapters in 4 with Adam's two fp32 moments; no gradient as
    large as the frozen embedding's."""
    from fairseq_fsdp2.estimator import from_args
    from fairseq_fsdp2.estimator.fsdp2_step import simulate_fsdp2

    argv = ["unused", "--task", "translation", "--vocab-size", "1000", "--arch",
            "transformer_nllb_tiny", "--max-tokens", "512", "--ddp-backend", "fsdp2",
            "--min-params-to-wrap", "1", "--optimizer", "adam", "--fp16"]
    args = from_args.parse(argv + ["--lora-rank", "4"])
    model = from_args.build_meta_model(args)
    profile = from_args.profile_for(args, model)  # adapts the model
    frozen = trained = 0
    for name, param in model.named_parameters():
        rows = -(-param.shape[0] // 2) if param.dim() else 1
        elements = rows * (param[0].numel() if param.dim() else 1)
        if param.requires_grad:
            assert lora.is_adapter(name), name
            trained += elements
        else:
            frozen += elements
    assert trained and frozen
    led = simulate_fsdp2(profile, from_args.setup_for(args, 2))
    assert led.now["sharded"] == 2 * frozen + 4 * trained
    assert led.now["optim"] == 8 * trained
    full = simulate_fsdp2(from_args.profile_for(from_args.parse(argv)),
                          from_args.setup_for(from_args.parse(argv), 2))
    embedding = 1000 * 64 * 2  # vocab x dim, fp16
    assert full.max["grads"] >= embedding > led.max["grads"]
