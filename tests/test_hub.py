"""fairseq's hub on what an NLLB-style FSDP2 run wrote (integration/hub.py, patch 10):
``TransformerModel.from_pretrained(...).translate(...)`` with ``translation_multi_simple_epoch``
on the consolidated export and on the sharded checkpoint gives stock ``fairseq-generate``'s
translations (no plugin in that process), without the target language tag.

One tiny run (1 process, the numbers corpus, 40 updates): its translations are poor, which does
not matter here: the hub must give, token for token, what fairseq-generate gives. Both decode one
sentence at a time (batch size 1), so that no batch's padding changes a float.
"""
from __future__ import annotations

import re

import pytest

from conftest import nllb_tiny_train_args
from launcher import ok, run_command, run_ranks

from fairseq_fsdp2.data import numbers
from fairseq_fsdp2.data.prepare import prepare

PAIRS = [("eng_Latn", "fra_Latn"), ("eng_Latn", "deu_Latn")]
N_TEST = 6
GENERATION = {"beam": 2, "max_len_b": 12}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    numbers.write_corpus(root / "raw", PAIRS, n_train=300, n_valid=10, n_test=N_TEST, seed=2)
    data = prepare(root / "raw", root / "data", vocab_size=120, log=lambda *a: None)
    save = root / "ckpt"
    # 40 updates: after 8 or 16 both pairs' translations were empty strings (tried: nothing
    # for the comparison to show). They are 5 epochs; --save-interval 1000: checkpoint_last
    # (and its export) written once, at the end, not also after epochs 1-4 (nobody read those)
    args = nllb_tiny_train_args(data, save, "--max-update", 40, "--save-interval", 1000,
                                lang_pairs=",".join(f"{s}-{t}" for s, t in PAIRS))
    ok(run_ranks(1, lambda rank: args))
    return root, data, save


#: the least spread of a model's scores over the test sentences (relative to their size) that
#: shows it reads its source: a model blind to it (a wrong load; an encoder whose output is
#: constant) scores every sentence alike up to float32 rounding, in sums over ~20 positions
#: (2^-24 relative each), far below 2^-10
READS_ITS_SOURCE = 2.0 ** -10


def stock_generate(data, checkpoint, target_lang="fra_Latn") -> tuple[list[str], list[float]]:
    """fairseq-generate's detokenized translations of the eng->target test set, in order, and
    their scores."""
    result = run_command(
        "fairseq_cli.generate", data, "--path", checkpoint,
        "--task", "translation_multi_simple_epoch", "--source-lang", "eng_Latn",
        "--target-lang", target_lang, "--lang-pairs", ",".join(f"{s}-{t}" for s, t in PAIRS),
        "--langs", (data / "langs.txt").read_text().strip(), "--encoder-langtok", "src",
        "--decoder-langtok", "--gen-subset", "test", "--beam", GENERATION["beam"],
        "--max-len-b", GENERATION["max_len_b"], "--batch-size", 1,
        "--required-batch-size-multiple", 1, "--cpu", "--num-workers", 0,
        "--remove-bpe", "sentencepiece")
    assert result.returncode == 0, result.output[-3000:]
    found = {int(m[1]): (m[3], float(m[2]))
             for m in re.finditer(r"^D-(\d+)\t(\S+)\t(.*)$", result.output, re.M)}
    assert sorted(found) == list(range(N_TEST)), result.output[-3000:]
    return [found[i][0] for i in range(N_TEST)], [found[i][1] for i in range(N_TEST)]


def assert_reads_its_source(scores: list[float]) -> None:
    """The translations differ between sentences: here in their scores (40 updates leave
    outputs that often coincide as text)."""
    spread = max(scores) - min(scores)
    assert spread > READS_ITS_SOURCE * max(abs(s) for s in scores), scores


def hub(save, data, checkpoint_file, target_lang="fra_Latn"):
    from fairseq.models.transformer import TransformerModel
    return TransformerModel.from_pretrained(
        str(save), checkpoint_file=checkpoint_file, data_name_or_path=str(data),
        task="translation_multi_simple_epoch", source_lang="eng_Latn", target_lang=target_lang,
        bpe="sentencepiece", sentencepiece_model=str(data / "spm.model"))


def translate(model, sentences) -> list[str]:
    return [model.translate(s, **GENERATION) for s in sentences]


def test_hub_translates_an_export_and_a_sharded_checkpoint_as_fairseq_generate(run):
    root, data, save = run
    sources = (root / "raw" / "test.eng_Latn-fra_Latn.eng_Latn").read_text().splitlines()
    expected, scores = stock_generate(data, save / "checkpoint_last_consolidated.pt")
    # the model reads its source: a wrong load that gives every sentence one output would make
    # any two readers agree
    assert_reads_its_source(scores)
    exported = hub(save, data, "checkpoint_last_consolidated.pt")
    assert translate(exported, sources) == expected
    # every sentence translated to something (empty outputs would agree with any reader) and
    # fairseq-generate strips the tag too
    assert all(expected) and not any("__" in t for t in expected), expected
    sharded = hub(save, data, "checkpoint_last.pt")  # its shards, read through patch 8
    assert translate(sharded, sources) == expected

    # the other pair, as fairseq-generate translates it: its tag is left out too
    sources = (root / "raw" / "test.eng_Latn-deu_Latn.eng_Latn").read_text().splitlines()
    german, scores = stock_generate(data, save / "checkpoint_last_consolidated.pt", "deu_Latn")
    assert_reads_its_source(scores)
    assert translate(hub(save, data, "checkpoint_last_consolidated.pt", "deu_Latn"),
                     sources) == german
    assert all(german) and not any("deu_Latn" in t for t in german), german

    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn"):
        exported.translate(sources[0], prefix_allowed_tokens_fn=lambda batch, tokens: [])
