"""Hugging Face NLLB interop: weights in and out (nllb_weights.py), the safetensors format
(safetensors_io.py) and which token HF's tokenizer expects on each row (vocab.py)."""
