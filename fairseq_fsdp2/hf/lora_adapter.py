"""A LoRA checkpoint's adapters as a PEFT adapter directory (``adapter_config.json``,
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto transformers'
NLLB (``M2M100ForConditionalGeneration``) model: ``python -m fairseq_fsdp2.consolidate
CHECKPOINT OUT --format peft``.

fairseq's ``lora_A``/``lora_B`` (models/lora.py) are PEFT's ``lora_A.weight``/``lora_B.weight``
of the same module under its Hugging Face name (nllb_weights.hf_name), with the same shapes and
formula (scaling = lora_alpha / r); PEFT's file keys carry its wrapper's prefix
``base_model.model.``. The base model is the run's --finetune-from-model, exported with
``--format hf`` if it was a fairseq checkpoint. Parameters trained in full beside the adapters
(--lora-train-params) have no place among PEFT's LoRA weights: such a checkpoint is refused
(one line), its merged export (``--format hf``) holds them.
"""
from __future__ import annotations

import json
import os

import torch

from ..errors import CheckpointError
from ..models import lora
from .nllb_weights import hf_name
from .safetensors_io import new_directory, write

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def adapter_config(info: dict, modules: list[str]) -> dict:
    """PEFT's LoraConfig fields for these adapters (``info``: the checkpoint header's "lora")."""
    return {"peft_type": "LORA", "task_type": "SEQ_2_SEQ_LM", "r": info["rank"],
            "lora_alpha": info["scaling"] * info["rank"], "lora_dropout": info["dropout"],
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None, "base_model_name_or_path": None}


def export(tensors: dict, info: dict, trained: list[str], out: str) -> str:
    """Write the PEFT directory ``out`` (must not exist or be empty; written beside it and
    renamed) from a LoRA checkpoint's full ``tensors`` (checkpoint/export.lora_tensors),
    its header's ``info`` and the names of its parameters trained in full."""
    if trained:
        raise CheckpointError(f"the checkpoint trained {trained[0]} in full beside the adapters "
                              f"(--lora-train-params), which a PEFT LoRA adapter cannot hold: "
                              f"export the merged model (--format hf) instead")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f"{out} exists and is not an empty directory")
    modules, weights = [], []
    for path in info["modules"]:
        name = hf_name(f"{path}.weight")[:-len(".weight")]
        modules.append(name)
        for part in (lora.LORA_A, lora.LORA_B):
            weights.append((f"{PEFT_PREFIX}{name}.{part}.weight",
                            tensors[f"{path}.{part}"].to(torch.float32).contiguous()))
    with new_directory(out) as tmp:
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(adapter_config(info, modules), f, indent=2)
        write(os.path.join(tmp, WEIGHTS), weights, metadata={"format": "pt"})
    return out
