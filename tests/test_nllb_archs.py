"""The NLLB-200 architectures build with the published parameter counts and a tied embedding.

Models are built on the meta device (no memory, ~1 s for all three) with a dictionary of the
NLLB-200 size, 256,206 entries, through fairseq's own argument parsing and TranslationTask.
"""
from __future__ import annotations

import pytest
import torch
from fairseq import options
from fairseq.data import Dictionary
from fairseq.tasks.translation import TranslationTask

import fairseq_fsdp2.models  # noqa: F401  (registers the architectures)

NLLB_VOCAB = 256_206


@pytest.fixture(scope="module")
def nllb_dict() -> Dictionary:
    d = Dictionary()  # starts with <s> <pad> </s> <unk>
    for i in range(NLLB_VOCAB - len(d)):
        d.add_symbol(f"tok{i}")
    assert len(d) == NLLB_VOCAB
    return d


def parse(arch: str, *extra: str):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser, ["unused-data-dir", "--task", "translation", "-s", "src", "-t", "tgt",
                 "--arch", arch, *extra])


def build_on_meta(arch: str, dictionary: Dictionary):
    args = parse(arch)
    task = TranslationTask(args, dictionary, dictionary)
    with torch.device("meta"):
        return task.build_model(args)


@pytest.mark.parametrize("arch,millions", [
    ("transformer_nllb_600m", 615.1),
    ("transformer_nllb_1_3b", 1370.6),
    ("transformer_nllb_3_3b", 3344.9),
])
def test_parameter_count_and_tied_embedding(arch, millions, nllb_dict):
    model = build_on_meta(arch, nllb_dict)
    params = list(model.parameters())  # unique parameters: the tie counts once
    assert round(sum(p.numel() for p in params) / 1e6, 1) == millions
    assert all(p.is_meta for p in params)

    embed = model.encoder.embed_tokens
    assert model.decoder.embed_tokens is embed
    assert model.decoder.output_projection.weight is embed.weight
    assert tuple(embed.weight.shape) == (NLLB_VOCAB, model.encoder.embed_tokens.embedding_dim)


def test_nllb_settings_and_command_line_override():
    args = parse("transformer_nllb_600m")
    assert (args.encoder_layers, args.decoder_layers) == (12, 12)
    assert (args.encoder_embed_dim, args.encoder_ffn_embed_dim) == (1024, 4096)
    assert (args.decoder_attention_heads, args.encoder_attention_heads) == (16, 16)
    assert args.share_all_embeddings and args.encoder_normalize_before
    assert args.decoder_normalize_before and not args.no_scale_embedding
    assert not args.encoder_learned_pos and not args.decoder_learned_pos
    assert (args.max_source_positions, args.max_target_positions) == (512, 512)
    assert (args.dropout, args.attention_dropout, args.activation_dropout) == (0.1, 0.1, 0.0)

    args = parse("transformer_nllb_tiny", "--encoder-layers", "3", "--dropout", "0.3",
                 "--max-source-positions", "1000")
    assert (args.encoder_layers, args.decoder_layers) == (3, 2)
    assert args.dropout == 0.3 and args.max_source_positions == 1000
    assert args.encoder_embed_dim == 64 and args.encoder_attention_heads == 4
    assert (args.attention_dropout, args.activation_dropout) == (0.1, 0.0)  # NLLB's, kept
