"""Hugging Face NLLB weights (``M2M100ForConditionalGeneration``) to and from the plugin's
``transformer_nllb_*`` models (fairseq's ``transformer``).

The two layouts are the same network: pre-norm layers with final encoder/decoder layer norms,
embeddings scaled by sqrt(dim), one embedding shared by encoder, decoder and output projection,
sinusoidal positions. HF's M2M100SinusoidalPositionalEmbedding is fairseq's
SinusoidalPositionalEmbedding (same table; positions start at ``padding_idx + 1`` in both, which
is HF's "offset 2" with pad = 1), so no position weights exist in either file. Names differ
only by HF's ``model.`` prefix and the embedding's aliases (HF: ``model.shared``,
``model.{encoder,decoder}.embed_tokens``, ``lm_head``; fairseq: ``{encoder,decoder}.embed_tokens``,
``decoder.output_projection``); fairseq also saves two ``version`` buffers (format markers).

Import: ``HFWeights`` is a read-only mapping from fairseq names to memory-mapped tensors of the
safetensors file(s): nothing is read until the broadcast copies one tensor
(``full_state.broadcast_full_model``), the shared embedding once. Export: ``export`` writes
config.json, generation_config.json and model.safetensors, and the tokenizer files data
preparation kept (tokenizer_files.py).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator, Optional

import torch

from ..errors import CheckpointError
from .safetensors_io import SafetensorsFile, new_directory, write
from .tokenizer_files import copy_tokenizer, largest_id
from .vocab import CONFIG_FILE, dictionary_problem, read_config

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
HF_EMBEDDING = ("model.shared.weight", "model.encoder.embed_tokens.weight",
                "model.decoder.embed_tokens.weight", "lm_head.weight")
FAIRSEQ_EMBEDDING = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                     "decoder.output_projection.weight")
#: fairseq's persistent format markers, with the value a freshly built model holds
FAIRSEQ_VERSIONS = {"encoder.version": 3.0, "decoder.version": 3.0}
#: sinusoidal tables some older transformers versions saved; both sides recompute them
HF_IGNORED = ("model.encoder.embed_positions.weights", "model.decoder.embed_positions.weights")
_LAYER = re.compile(r"^model\.(encoder|decoder)\.layers\.(\d+)\.")


def is_hf_source(path: str) -> bool:
    """A Hugging Face model directory (config.json + safetensors) or a .safetensors file."""
    p = Path(path)
    if p.is_dir():
        return (p / CONFIG_FILE).is_file() and ((p / WEIGHTS).is_file()
                                                         or (p / INDEX).is_file())
    return p.is_file() and p.suffix == ".safetensors"


def fairseq_name(hf_name: str) -> Optional[str]:
    if hf_name in HF_EMBEDDING:
        return FAIRSEQ_EMBEDDING[0]
    return hf_name[len("model."):] if hf_name.startswith("model.") else None


def hf_name(fairseq: str) -> str:
    return HF_EMBEDDING[0] if fairseq in FAIRSEQ_EMBEDDING else "model." + fairseq


class HFWeights(Mapping):
    """fairseq name -> tensor (a view of the mapped file) for an HF NLLB model."""

    def __init__(self, path: str):
        self.path = path
        p = Path(path)
        self.config = read_config(p)
        if self.config is not None and self.config.get("model_type") != "m2m_100":
            raise CheckpointError(
                f"{path} is a Hugging Face {self.config.get('model_type')!r} model "
                f"({', '.join(self.config.get('architectures') or ['?'])}), not NLLB "
                f"(model_type 'm2m_100', M2M100ForConditionalGeneration)")
        if p.is_dir() and not (p / WEIGHTS).is_file():
            weight_map = json.loads((p / INDEX).read_text())["weight_map"]
            files = {f: SafetensorsFile(str(p / f)) for f in sorted(set(weight_map.values()))}
            self._files = {name: files[f] for name, f in weight_map.items()}
        else:
            single = SafetensorsFile(str(p / WEIGHTS if p.is_dir() else p))
            self._files = {name: single for name in single.keys()}
        present = [k for k in HF_EMBEDDING if k in self._files]
        if not present:
            raise CheckpointError(f"{path} holds no shared embedding ({HF_EMBEDDING[0]}): "
                                  f"not an NLLB (M2M100) model")
        self.embedding = present[0]  # the tied copies are the same tensor: read one
        self.unexpected = sorted(k for k in self._files
                                 if fairseq_name(k) is None and k not in HF_IGNORED)
        self._names = {fairseq_name(k): k for k in self._files
                       if k not in HF_EMBEDDING and k not in HF_IGNORED and fairseq_name(k)}
        for alias in FAIRSEQ_EMBEDDING:
            self._names[alias] = self.embedding

    def layers(self) -> tuple[int, int]:
        found = {"encoder": set(), "decoder": set()}
        for name in self._files:
            m = _LAYER.match(name)
            if m:
                found[m[1]].add(int(m[2]))
        return len(found["encoder"]), len(found["decoder"])

    def shape(self, name: str) -> tuple[int, ...]:
        if name in FAIRSEQ_VERSIONS:
            return (1,)
        return self._files[self._names[name]].shape(self._names[name])

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in FAIRSEQ_VERSIONS:
            return torch.tensor([FAIRSEQ_VERSIONS[name]])
        hf = self._names[name]
        return self._files[hf].tensor(hf)

    def __iter__(self) -> Iterator[str]:
        yield from self._names
        yield from FAIRSEQ_VERSIONS

    def __len__(self) -> int:
        return len(self._names) + len(FAIRSEQ_VERSIONS)


def check_fits(weights: HFWeights, model_cfg, own_shapes: dict[str, tuple]) -> Optional[str]:
    """Why the HF weights cannot load into the fairseq model (one line), or None."""
    def g(key, default=None):
        return getattr(model_cfg, key, default)

    where = weights.path
    if weights.unexpected:
        return (f"{where} is not the NLLB (M2M100) layout: unexpected tensor "
                f"{weights.unexpected[0]}")
    layers = weights.layers()
    want = (g("encoder_layers"), g("decoder_layers"))
    if layers != want:
        return (f"{where} has {layers[0]} encoder and {layers[1]} decoder layers, the model "
                f"(--arch {g('arch')}) {want[0]} and {want[1]}")
    config = weights.config or {}
    settings = [
        ("encoder_attention_heads", g("encoder_attention_heads")),
        ("decoder_attention_heads", g("decoder_attention_heads")),
        ("scale_embedding", not g("no_scale_embedding")),
        ("activation_function", g("activation_fn")),
        ("tie_word_embeddings", True), ("pad_token_id", 1), ("eos_token_id", 2),
    ]
    for key, ours in settings:
        if key in config and config[key] != ours:
            return f"{where}: config.json has {key}={config[key]!r}, the model {ours!r}"
    layout = {"--share-all-embeddings": g("share_all_embeddings"),
              "--encoder-normalize-before": g("encoder_normalize_before"),
              "--decoder-normalize-before": g("decoder_normalize_before"),
              "sinusoidal positions": not (g("encoder_learned_pos") or g("decoder_learned_pos"))}
    missing_flags = [flag for flag, on in layout.items() if not on]
    if missing_flags:
        return (f"the model (--arch {g('arch')}) lacks {', '.join(missing_flags)}, which "
                f"NLLB weights from Hugging Face need (use a transformer_nllb_* arch)")
    for name, shape in own_shapes.items():
        if name not in weights:
            return f"{where} has no {hf_name(name)} (the model's {name})"
        if tuple(weights.shape(name)) != tuple(shape):
            return (f"{where}: {hf_name(name)} is {tuple(weights.shape(name))}, the model's "
                    f"{name} {tuple(shape)}")
    extra = sorted(set(weights) - set(own_shapes))
    if extra:
        return f"{where}: {hf_name(extra[0])} has no place in the model"
    return None


def open_checked(path: str, model_cfg, own_shapes: dict[str, tuple],
                 symbols: list[str]) -> HFWeights:
    """The weights of ``path``, checked against the model and its dictionary. An embedding
    with fewer rows than the model's is accepted when the dictionary begins with its rows
    (the caller grows it: checkpoint/grown_embedding.py)."""
    weights = HFWeights(path)
    rows = weights.shape(FAIRSEQ_EMBEDDING[0])[0]
    own = {k: (rows, *v[1:]) if k in FAIRSEQ_EMBEDDING else v  # rows: the dictionary check
           for k, v in own_shapes.items()}
    problem = check_fits(weights, model_cfg, own) or \
        dictionary_problem(Path(path), symbols, rows)
    if problem:
        raise CheckpointError(problem)
    return weights


# --- export -----------------------------------------------------------------------------------

def hf_config(model_cfg: dict, vocab: int) -> dict:
    """config.json of M2M100ForConditionalGeneration for a fairseq NLLB-layout model."""
    g = model_cfg.get
    needed = {
        "--share-all-embeddings": g("share_all_embeddings"),
        "--encoder-normalize-before": g("encoder_normalize_before"),
        "--decoder-normalize-before": g("decoder_normalize_before"),
        "sinusoidal positions": not (g("encoder_learned_pos") or g("decoder_learned_pos")),
        "no --layernorm-embedding": not g("layernorm_embedding"),
        "a final decoder layer norm": not g("no_decoder_final_norm"),
        "equal encoder and decoder dims": g("encoder_embed_dim") == g("decoder_embed_dim")
        == (g("decoder_output_dim") or g("decoder_embed_dim")),
        "no adaptive softmax or input": not (g("adaptive_softmax_cutoff") or g("adaptive_input")),
        "no cross-self-attention": not g("cross_self_attention"),
    }
    lacking = [what for what, ok in needed.items() if not ok]
    if lacking:
        raise CheckpointError(f"the model is not the NLLB (M2M100) layout Hugging Face "
                              f"loads: it needs {', '.join(lacking)}")
    return {
        "architectures": ["M2M100ForConditionalGeneration"], "model_type": "m2m_100",
        "vocab_size": vocab, "d_model": g("encoder_embed_dim"),
        "encoder_layers": g("encoder_layers"), "decoder_layers": g("decoder_layers"),
        "encoder_ffn_dim": g("encoder_ffn_embed_dim"),
        "decoder_ffn_dim": g("decoder_ffn_embed_dim"),
        "encoder_attention_heads": g("encoder_attention_heads"),
        "decoder_attention_heads": g("decoder_attention_heads"),
        "max_position_embeddings": max(g("max_source_positions"), g("max_target_positions")),
        "activation_function": g("activation_fn") or "relu",
        "dropout": g("dropout"), "attention_dropout": g("attention_dropout") or 0.0,
        "activation_dropout": g("activation_dropout") or g("relu_dropout") or 0.0,
        "encoder_layerdrop": g("encoder_layerdrop") or 0.0,
        "decoder_layerdrop": g("decoder_layerdrop") or 0.0,
        "scale_embedding": not g("no_scale_embedding"), "tie_word_embeddings": True,
        "is_encoder_decoder": True, "use_cache": True, "init_std": 0.02,
        "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2,
    }


GENERATION_CONFIG = {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2,
                     "decoder_start_token_id": 2, "max_length": 200}


def hf_tensors(model: dict) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of a fairseq model state dict, the shared embedding once."""
    pairs = [(HF_EMBEDDING[0], model[FAIRSEQ_EMBEDDING[0]])]
    for name, tensor in model.items():
        if name in FAIRSEQ_EMBEDDING or name in FAIRSEQ_VERSIONS or name.endswith(
                ("embed_positions._float_tensor", "embed_positions.weights")):
            continue  # format markers; sinusoidal tables (older fairseq saved them)
        if not name.startswith(("encoder.layers.", "decoder.layers.", "encoder.layer_norm.",
                                "decoder.layer_norm.")):
            raise CheckpointError(f"the model has {name}, which the NLLB (M2M100) layout "
                                  f"Hugging Face loads has no place for")
        pairs.append((hf_name(name), tensor))
    return pairs


def export(model: dict, model_cfg: dict, out: str, tokenizer: Optional[str] = None) -> str:
    """Write an HF model directory ``out`` (must not exist or be empty; written in a temporary
    directory beside it and renamed, so a failure leaves nothing half-written), with the
    tokenizer files of the directory ``tokenizer`` if given (the data's DATA/hf_tokenizer)."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f"{out} exists and is not an empty directory")
    if FAIRSEQ_EMBEDDING[0] not in model:
        raise CheckpointError("the model has no shared embedding (encoder.embed_tokens.weight)")
    embedding = model[FAIRSEQ_EMBEDDING[0]]
    config = hf_config(model_cfg, embedding.shape[0])
    config["dtype"] = str(embedding.dtype).removeprefix("torch.")
    tensors = hf_tensors(model)
    if tokenizer is not None:
        largest = largest_id(Path(tokenizer))
        if largest is not None and largest >= embedding.shape[0]:
            raise CheckpointError(f"the tokenizer in {tokenizer} has ids up to {largest}, the "
                                  f"model's embedding {embedding.shape[0]} rows: not this "
                                  f"model's tokenizer")
    with new_directory(out) as tmp:
        for name, content in (("config.json", config),
                              ("generation_config.json", GENERATION_CONFIG)):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(content, f, indent=2)
        write(os.path.join(tmp, WEIGHTS), tensors, metadata={"format": "pt"})
        if tokenizer is not None:
            copy_tokenizer(Path(tokenizer), Path(tmp))
    return out
