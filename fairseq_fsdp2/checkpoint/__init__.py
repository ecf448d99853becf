"""Checkpoint state for sharded training."""
