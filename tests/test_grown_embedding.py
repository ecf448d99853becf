"""Fine-tuning into a bigger shared embedding (checkpoint/grown_embedding.py), for real.

A tiny "pretrained" model (FSDP2, 1 rank, 1 update) has a 54-row tied embedding; the data's
dictionary is grown to 70 entries (a new language code __lat_Latn__ and 15 words). 70 divides
by neither 3 nor 4: FSDP2 cuts the grown embedding into uneven shards (3 ranks: 24, 24, 22 rows,
the last rank's a shorter mix of pretrained and new rows, every rank a batch; 4 ranks: three of
18 and, on the last rank, exactly the 16 new rows, one rank with an empty batch). PyTorch
reported tied weights under uneven sharding whose last rank's rows were never updated (pytorch
#176076). Here one SGD update from the grown model at 3 and 4 ranks (each one shared run) is
compared row by row with stock fairseq's legacy_ddp run from the same grown weights (grown
offline by the same rule, written as a stock checkpoint; 1 rank x --update-freq 3: the same
three batches as 3 ranks', summed over micro-batches instead of ranks, two processes fewer):
every row that receives a gradient changes, and equals the stock run's row within the float32
bound derived in ``row_tolerance``.
A 2-rank run with lr 0 from the pretrained model's sharded checkpoint shows the rows as loaded:
the pretrained ones bit for bit, the new ones by the stated rule.
"""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fairseq_fsdp2  # noqa: F401  (allow-lists fairseq's pickled classes for torch.load)

from conftest import PLUGIN, STOCK_DDP, TINY_MODEL
from launcher import finish_ranks, ok, start_ranks
from numerics import U32

from fairseq_fsdp2.checkpoint.grown_embedding import plan_rows
from fairseq_fsdp2.data.preprocess import run_preprocess
from fairseq_fsdp2.hf.nllb_weights import FAIRSEQ_EMBEDDING
from fairseq_fsdp2.options import new_lang_sources

EMBEDDING = FAIRSEQ_EMBEDDING[0]
SPECIALS = 4
OLD_WORDS, NEW_WORDS = 48, 15
#: the pretrained dictionary: fairseq's 4 specials, two language codes, 48 words (54 rows:
#: 3 x 18, so that on 4 ranks, 18 rows each, the last rank holds exactly the new rows);
#: grown: + a new language code and 15 new words (70 rows)
OLD = ["__eng_Latn__", "__fra_Latn__"] + [f"w{i}" for i in range(OLD_WORDS)]
NEW = ["__lat_Latn__"] + [f"w{i}" for i in range(OLD_WORDS, OLD_WORDS + NEW_WORDS)]
OLD_ROWS, ROWS = SPECIALS + len(OLD), SPECIALS + len(OLD) + len(NEW)
LR = 0.5
SENTENCES, BATCH = 12, 4  # three batches: one per rank on 3 ranks; more ranks: empty batches
#: a shorter last shard mixing pretrained and new rows (3); a last shard of exactly the new
#: rows, and a rank with an empty batch (4)
WORLDS = (3, 4)
INIT = ["--init-new-langs-from", "eng_Latn"]


def write_corpus(root: Path, tokens: list[str], name: str) -> Path:
    """Binarize the raw text of root/raw with the dictionary ``tokens`` into root/name."""
    (root / name).mkdir()
    for side in ("src", "tgt"):
        (root / name / f"dict.{side}.txt").write_text("".join(f"{t} 1\n" for t in tokens))
    run_preprocess(["--source-lang", "src", "--target-lang", "tgt",
                    "--trainpref", root / "raw" / "train", "--validpref", root / "raw" / "valid",
                    "--srcdict", root / name / "dict.src.txt",
                    "--tgtdict", root / name / "dict.tgt.txt",
                    "--destdir", root / name, "--workers", "1"])
    return root / name


def train_args(data: Path, save: Path, source, *extra, lr=LR) -> list[str]:
    """One SGD update of the tiny model (no dropout: the float64 recomputation below is the
    same function), every batch of BATCH sentences."""
    model = [f if f != "0.1" else "0" for f in TINY_MODEL]  # --dropout 0
    return [str(data), "--user-dir", PLUGIN, *model, "--optimizer", "sgd", "--lr", str(lr),
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--batch-size", str(BATCH), "--max-tokens", "100000",
            "--required-batch-size-multiple", "1", "--max-update", "1", "--seed", "1",
            "--log-format", "json", "--log-interval", "1", "--cpu", "--no-progress-bar",
            "--disable-validation", "--num-workers", "0", "--no-epoch-checkpoints",
            "--save-dir", str(save), *map(str, extra)] + (
                ["--finetune-from-model", str(source)] if source else [])


def fsdp2(data, save, source, world, *extra, lr=LR):
    return start_ranks(world, lambda r: train_args(
        data, save, source, "--ddp-backend", "fsdp2", "--min-params-to-wrap", "1", *extra,
        lr=lr))


def embedding(path: Path) -> torch.Tensor:
    return torch.load(path, weights_only=True)["model"][EMBEDDING]


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    root = tmp_path_factory.mktemp("grown")
    rng = random.Random(5)
    (root / "raw").mkdir()
    words = OLD_WORDS + NEW_WORDS
    for split, n in (("train", SENTENCES), ("valid", 2)):
        src = [[rng.randrange(words) for _ in range(rng.randint(3, 8))] for _ in range(n)]
        src[0][:NEW_WORDS] = range(OLD_WORDS, words)  # every new word occurs
        (root / "raw" / f"{split}.src").write_text(
            "".join(" ".join(f"w{i}" for i in s) + "\n" for s in src))
        (root / "raw" / f"{split}.tgt").write_text(
            "".join(" ".join(f"w{(7 * i + 3) % words}" for i in reversed(s)) + "\n"
                    for s in src))
    small, data = write_corpus(root, OLD, "small"), write_corpus(root, OLD + NEW, "data")

    # the pretrained model: 1 FSDP2 update on the small dictionary (sharded + consolidated)
    ok(finish_ranks(fsdp2(small, root / "pretrained", None, 1), timeout=240))
    sharded = root / "pretrained" / "checkpoint_last.pt"
    consolidated = root / "pretrained" / "checkpoint_last_consolidated.pt"

    # the same weights grown offline by the rule the FSDP2 runs apply when loading, as a stock
    # checkpoint for stock fairseq
    state = torch.load(consolidated, weights_only=True)
    symbols = ["<s>", "<pad>", "</s>", "<unk>", *OLD, *NEW]
    plan = plan_rows(symbols, OLD_ROWS, new_lang_sources("eng_Latn"))
    weight = plan.grow(state["model"][EMBEDDING])
    state["model"].update({k: weight for k in FAIRSEQ_EMBEDDING})
    torch.save(state, root / "grown.pt")

    # stock on 1 rank x 3 micro-batches: the global batch of 3 ranks (row_tolerance)
    runs = {"stock": start_ranks(1, lambda r: train_args(
                data, root / "stock", root / "grown.pt", *STOCK_DDP,
                "--distributed-world-size", 1, "--distributed-rank", r, "--update-freq", 3)),
            "loaded": fsdp2(data, root / "loaded", sharded, 2, *INIT, lr=0),
            # LoRA adding the language: adapters and the new rows train (docs/lora.md)
            "lora": fsdp2(data, root / "lora", consolidated, 2, *INIT, "--lora-rank", 4,
                          "--lora-train-new-rows")}
    for world in WORLDS:
        runs[world] = fsdp2(data, root / f"fsdp2_{world}", consolidated, world, *INIT)
    outputs = {name: ok(finish_ranks(procs, timeout=600)) for name, procs in runs.items()}
    return SimpleNamespace(root=root, data=data, outputs=outputs, symbols=symbols, plan=plan,
                           pretrained=embedding(consolidated).clone(), initial=weight,
                           stock=embedding(root / "stock" / "checkpoint_last.pt"))


def fsdp2_result(grown, name) -> torch.Tensor:
    return embedding(grown.root / name / "checkpoint_last_consolidated.pt")


def test_loaded_rows_pretrained_bit_for_bit_and_new_as_stated(grown):
    """The lr-0 run from the sharded checkpoint: its weights are the loaded ones."""
    loaded = fsdp2_result(grown, "loaded")
    assert loaded.shape == (ROWS, 32)
    assert torch.equal(loaded[:OLD_ROWS], grown.pretrained)  # bit for bit
    lat, eng = grown.symbols.index("__lat_Latn__"), grown.symbols.index("__eng_Latn__")
    assert torch.equal(loaded[lat], grown.pretrained[eng])
    # the mean is summed in float64 (its error ~1e-16 relative) and rounded once to float32:
    # within one float32 rounding (half an ulp, 2**-24 relative) of the float64 mean
    mean = grown.pretrained.double().mean(0)
    for row in range(OLD_ROWS, ROWS):
        if row != lat:
            assert ((loaded[row].double() - mean).abs() <= mean.abs() * U32).all(), row
    assert torch.equal(loaded, grown.initial)  # the offline growth the stock run starts from
    assert "model built on the meta device" in grown.outputs["loaded"]  # no full copy
    lines = [line for line in grown.outputs["loaded"].splitlines() if "grew the shared" in line]
    assert len(lines) == 1 and f"from {OLD_ROWS} to {ROWS} rows" in lines[0] and \
        f"__lat_Latn__ from the row of __eng_Latn__; {NEW_WORDS} as the mean of the " \
        f"{OLD_ROWS} pretrained rows" in lines[0], lines


def gradient_terms(grown) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute the update's gradient of the embedding in float64 on the whole training set
    (the three batches, which are all the data): the sum of the absolute values of the terms
    that make each element (``A``: output-projection products |dL/dlogit| x |feature| and the
    looked-up rows' gradients, both over every token, divided by the sample size as the
    trainer divides), and how many lookups of each row there are."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = train_args(grown.data, grown.root / "f64", None)
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), args))
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    state = torch.load(grown.root / "grown.pt", weights_only=True)["model"]
    model.load_state_dict(state, strict=True)
    model = model.double().train()
    dataset = task.dataset("train")
    sample = dataset.collater([dataset[i] for i in range(len(dataset))])
    assert len(dataset) == SENTENCES
    captured = []

    def keep(module, inputs, output):
        grads = {}
        output.register_hook(lambda g: grads.setdefault("g", g))
        captured.append((module, inputs[0], grads))

    hooks = [model.encoder.embed_tokens.register_forward_hook(keep),
             model.decoder.output_projection.register_forward_hook(keep)]
    loss, sample_size, _ = criterion(model, sample)
    loss.backward()
    for h in hooks:
        h.remove()
    terms = torch.zeros(ROWS, 32, dtype=torch.float64)
    lookups = torch.zeros(ROWS, dtype=torch.float64)
    for module, inputs, grads in captured:
        g = grads["g"].reshape(-1, grads["g"].shape[-1]).abs()
        if module is model.decoder.output_projection:
            terms += g.t() @ inputs.reshape(-1, inputs.shape[-1]).abs()
        else:
            tokens = inputs.reshape(-1)
            real = tokens != task.source_dictionary.pad()
            terms.index_add_(0, tokens[real], g[real])
            lookups.index_add_(0, tokens[real], torch.ones(int(real.sum()), dtype=torch.float64))
    return terms / sample_size, lookups


def row_tolerance(terms: torch.Tensor, lookups: torch.Tensor, world: int,
                  stock_update: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The most two float32 runs of this one SGD update can differ by, element by element.

    Both runs compute the same per-batch terms: the same weights (the FSDP2 load equals the
    stock run's grown file, test above), the same three batches (they do not depend on the
    world size: one on each FSDP2 rank, ranks beyond the third getting empty batches, which
    fairseq runs with their loss times 0: exact zeros; the stock run's three micro-batches on
    its one rank), the same kernels up to each batch's weight gradients. They differ in how
    they sum them: per batch the output projection's product and each lookup's row (the
    tied-gradient buffer adds them in another order than autograd), then across the batches
    (FSDP2's reduce-scatter over the ranks against stock's accumulation of the micro-batches'
    gradients), each term perhaps pre-scaled. A sum of m terms in any order is within gamma(m)
    x sum|terms| of the exact sum (gamma(m) = m u / (1 - m u), u the float32 unit roundoff); a
    pre-scaled term adds u |term|: counted as one more term. Here m is at most 3 products + the
    row's lookups + one (zero) term per other FSDP2 rank (none on stock's one rank), so each run is
    within gamma(m + 1) x A of the exact gradient (``terms``: A, from float64 values of the same
    terms; twice A covers their float32 values, which differ from them relatively by about the
    depth of the network times u). The scalings after the sum (averaging, 1/sample size) are at
    most 4 roundings of the gradient per run (4 u |g| each), and the step p - lr g rounds twice
    (lr g, then the difference: u |g| lr and u |p'|)."""
    m = 3 + lookups + world + 1
    gamma = m * U32 / (1 - m * U32)
    grad = stock_update.abs() / LR
    return LR * (2 * gamma[:, None] * 2 * terms + 2 * 5 * U32 * grad) + 2 * U32 * after.abs()


@pytest.fixture(scope="module")
def f64_terms(grown):
    return gradient_terms(grown)


@pytest.mark.parametrize("world", WORLDS)
def test_every_rows_shard_trains_as_stock_legacy_ddp(grown, f64_terms, world):
    terms, lookups = f64_terms
    ours = fsdp2_result(grown, f"fsdp2_{world}").double()
    stock, initial = grown.stock.double(), grown.initial.double()
    tol = row_tolerance(terms, lookups, world, stock - initial,
                        torch.maximum(ours.abs(), stock.abs()))
    gets_gradient = terms.amax(1) > 0
    assert gets_gradient.all()  # the output projection reaches every row
    moved = ((ours - initial).abs() > tol).any(1)  # by more than rounding could
    chunk = -(-ROWS // world)  # FSDP2's Shard(0): ceil(rows / world) rows per rank
    assert ROWS % world  # uneven shards
    if world == 4:  # the last rank's shard: exactly the new rows (module docstring)
        assert (world - 1) * chunk == OLD_ROWS
    for rank in range(world):
        rows = range(rank * chunk, min((rank + 1) * chunk, ROWS))
        assert all(moved[r] for r in rows), (rank, [r for r in rows if not moved[r]])
    assert moved[OLD_ROWS:].all()  # the grown rows, on the last rank(s)
    worst = ((ours - stock).abs() / tol).max().item()
    print(f"{world} ranks: largest |fsdp2 - stock| / tolerance = {worst:.3g}")
    assert ((ours - stock).abs() <= tol).all(), worst
    assert ((stock - initial).abs() > tol).any(1).all()  # the stock run moved every row too


def test_lora_trains_the_new_rows_and_keeps_the_pretrained_ones_bit_for_bit(grown):
    """--lora-rank 4 --lora-train-new-rows from the pretrained model (one SGD update, 2 ranks):
    the pretrained rows and every other pretrained weight are the loaded ones bit for bit (the
    merged export: the adapters are merged into the linear weights, which therefore move), the
    new rows moved (they received gradients: the new words occur in the batch, and every row
    takes part in the output projection's softmax)."""
    out = grown.outputs["lora"]
    assert "LoRA rank 4" in out and f"{ROWS * 32:,} more trained in full" in out, out[-3000:]
    result = fsdp2_result(grown, "lora")
    assert torch.equal(result[:OLD_ROWS], grown.initial[:OLD_ROWS])
    assert all(not torch.equal(result[r], grown.initial[r]) for r in range(OLD_ROWS, ROWS))
    saved = torch.load(grown.root / "lora" / "checkpoint_last.pt", weights_only=True)
    assert saved["fsdp2"]["lora"]["pretrained_rows"] == OLD_ROWS
