"""A Hugging Face NLLB directory (``M2M100ForConditionalGeneration``) as an evaluation model:
fairseq's ``transformer`` built with the NLLB layout at the dimensions config.json gives, its
weights read from the safetensors files by the project's own reader (hf/nllb_weights.py, the
reader ``--finetune-from-model DIR`` uses) and checked as fine-tuning checks them: the layout,
every tensor's shape, and DATA's dictionary lining up with the model's tokenizer rows (data
prepared with ``scripts/prepare_data.sh --hf-model DIR``)."""
from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from ..hf.nllb_weights import HFWeights, check_fits


def model_argv(config: dict) -> list[str]:
    """fairseq-train's model flags for the NLLB layout at config.json's dimensions."""
    c = config
    argv = ["--arch", "transformer", "--share-all-embeddings", "--encoder-normalize-before",
            "--decoder-normalize-before", "--activation-fn", c.get("activation_function", "relu"),
            "--max-source-positions", str(c.get("max_position_embeddings", 1024)),
            "--max-target-positions", str(c.get("max_position_embeddings", 1024))]
    for side in ("encoder", "decoder"):
        argv += [f"--{side}-layers", str(c[f"{side}_layers"]),
                 f"--{side}-embed-dim", str(c["d_model"]),
                 f"--{side}-ffn-embed-dim", str(c[f"{side}_ffn_dim"]),
                 f"--{side}-attention-heads", str(c[f"{side}_attention_heads"])]
    if not c.get("scale_embedding", True):
        argv.append("--no-scale-embedding")
    return argv


def build(path: Path, task, data: str):
    """The fairseq model holding the directory's weights (float32, eval mode)."""
    from fairseq import options
    weights = HFWeights(str(path))
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [data, "--task", "translation_multi_simple_epoch",
                                                *model_argv(weights.config or {})])
    model = task.build_model(args)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problem = check_fits(weights, args, own)
    if problem:
        raise CheckpointError(problem)
    model.load_state_dict({k: weights[k] for k in own}, strict=True)
    return model.eval()
