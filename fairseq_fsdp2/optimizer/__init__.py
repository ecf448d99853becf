"""The optimizer step on sharded parameters: fairseq's optimizer built over them (build.py), the
precision flags (mixed_precision.py, loss_scale.py), the global gradient norm (grad_norm.py),
elementwise work on the local shards (local_shard_step.py), Adafactor's state
(adafactor_state.py), Adam's moments in 16 or 8 bits (adam_stats.py, stochastic_round.py,
blockwise_8bit.py, fit_saved_state.py)."""
