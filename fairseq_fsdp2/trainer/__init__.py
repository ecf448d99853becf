"""fairseq's Trainer for FSDP2 (fsdp2_trainer.py), its checkpoint methods (checkpoint_hooks.py),
the sharded EMA (ema.py) and the exact resume (resume.py)."""
