"""Sharding the model with FSDP2: the plan as data (plan.py), applying it (apply_plan.py) on a
device mesh (mesh.py), gloo's collectives for FSDP2 (gloo_collectives.py), one gradient buffer for
the tied embedding (tied_grad_buffer.py), and the meta-device build (meta_build.py)."""
