"""NLLB-200 dense model sizes as named fairseq architectures of the stock ``transformer`` model.

NLLB-200 trained its dense models with fairseq's ``--arch transformer`` plus flags; naming the
sizes here lets recipes, tests and memory estimates say ``--arch transformer_nllb_600m`` instead
of repeating a dozen flags, and the parameter counts can be checked against the published ones
(600M: 615.1M, 1.3B: 1370.6M, 3.3B: 3344.9M with the 256,206-entry NLLB dictionary).
``transformer_nllb_tiny`` has the same layout at toy size, for tests and the CPU demo.

Every value is a default only (``getattr(args, name, default)``), so command-line flags such as
``--encoder-layers`` or ``--dropout`` still override it.
"""
from __future__ import annotations

from fairseq.models import register_model_architecture
from fairseq.models.transformer.transformer_legacy import base_architecture

# (layers per stack, embedding dim, ffn dim, attention heads); encoder and decoder are equal.
NLLB_SIZES = {
    "transformer_nllb_tiny": dict(layers=2, dim=64, ffn=128, heads=4),
    "transformer_nllb_600m": dict(layers=12, dim=1024, ffn=4096, heads=16),
    "transformer_nllb_1_3b": dict(layers=24, dim=1024, ffn=8192, heads=16),
    "transformer_nllb_3_3b": dict(layers=24, dim=2048, ffn=8192, heads=16),
}

# Settings shared by every size (NLLB-200 training grids).
NLLB_COMMON = dict(
    share_all_embeddings=True,
    encoder_normalize_before=True,
    decoder_normalize_before=True,
    no_scale_embedding=False,       # embeddings scaled by sqrt(dim)
    encoder_learned_pos=False,      # sinusoidal positions
    decoder_learned_pos=False,
    max_source_positions=512,
    max_target_positions=512,
    dropout=0.1,
    attention_dropout=0.1,
    activation_dropout=0.0,         # NLLB's "relu dropout"
)


def _defaults(size: dict) -> dict:
    values = dict(NLLB_COMMON)
    for side in ("encoder", "decoder"):
        values.update({
            f"{side}_layers": size["layers"],
            f"{side}_embed_dim": size["dim"],
            f"{side}_ffn_embed_dim": size["ffn"],
            f"{side}_attention_heads": size["heads"],
        })
    return values


def _register(name: str, size: dict) -> None:
    defaults = _defaults(size)

    def arch(args):
        for key, value in defaults.items():
            setattr(args, key, getattr(args, key, value))
        base_architecture(args)

    arch.__name__ = arch.__qualname__ = name
    arch.__doc__ = f"NLLB-200 layout: {size}, plus NLLB_COMMON."
    register_model_architecture("transformer", name)(arch)


for _name, _size in NLLB_SIZES.items():
    _register(_name, _size)
