"""Hugging Face NLLB interop: weights in and out (nllb_weights.py), the safetensors format
(safetensors_io.py), which token HF's tokenizer expects on each row (vocab.py), its tokenizer
files copied and grown (tokenizer_files.py), and LoRA's adapters as a PEFT adapter directory
(lora_adapter.py)."""
