"""Checkpoint formats and their I/O: sharded DCP checkpoints in fairseq's file layout
(sharded.py), written in the background (async_save.py), full state into shards (full_state.py),
a pretrained embedding grown for a bigger dictionary (grown_embedding.py), the consolidated export
(export.py), legacy FSDP's per-rank shards (legacy_fairscale.py), safe loading (safe_load.py), the
shared --save-dir check (shared_dir.py)."""
