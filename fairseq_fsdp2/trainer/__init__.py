"""fairseq's Trainer for FSDP2 (fsdp2_trainer.py), its checkpoint methods (checkpoint_hooks.py) and
the exact resume (resume.py)."""
