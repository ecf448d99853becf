"""The optimizer step on sharded parameters: fairseq's optimizer built over them (build.py), the
precision flags (mixed_precision.py, loss_scale.py), the global gradient norm (grad_norm.py),
elementwise work on the local shards (local_shard_step.py), Adafactor's state
(adafactor_state.py), and Adam's step with its moments stored in another format between steps:
composed once from the formats, a bucket of parameters (adam_stats.py) or a chunk of rows
(row_chunk_step.py) at a time. What a moment format is (fp32, fp16, bf16, 8 bits: its dtype,
side keys, widening, narrowing, bytes), with the 8-bit kernel: moments/."""
