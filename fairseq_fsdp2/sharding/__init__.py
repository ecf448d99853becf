"""Sharding the model with FSDP2: the plan as data (plan.py), its units made with fully_shard on a
device mesh (units.py, mesh.py), gloo's collectives for FSDP2 (gloo_collectives.py), one gradient
buffer for the tied embedding (tied_grad_buffer.py) and its early reduce into the shard
(tied_grad_reduce.py), gradient shards kept in the 16-bit reduce dtype (sixteen_bit_grads.py),
the meta-device build (meta_build.py), and layers every rank drops alike (layerdrop.py)."""
