"""Gradient shards kept in FSDP2's reduce dtype (``--fsdp2-reduce-dtype fp16/bf16``).

What: FSDP2 reduce-scatters the gradients in the reduce dtype and then casts each rank's output
to the parameters' fp32 (``foreach_reduce``: ``reduce_output`` cast to ``orig_dtype``): a 4-byte
gradient shard per parameter element whose value is the 16-bit one widened, exactly. Kept in
the reduce dtype, the shards take 2 bytes; the optimizer widens them a chunk of rows at a time
(optimizer/row_chunk_step.py), which gives the float32 values FSDP2 would have stored, so the
update is the same bit for bit (tests/test_narrow_grads.py).

How: the parameters accept a gradient of another dtype (``Tensor.grad_dtype = None``, public
since torch 2.9), and each FSDP2 parameter group's ``_orig_dtype``, the dtype ``foreach_reduce``
casts to, is set to the reduce dtype. That attribute is private (torch 2.13,
``torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup``): no public setting
keeps the reduce dtype (``MixedPrecisionPolicy`` has none). FSDP2 sets it at its lazy
initialization, in the root's first forward pre-hook, so a forward pre-hook of the root
registered after it sets it again (idempotent, a few attribute writes). A torch that renames
it fails ``tests/test_narrow_grads.py`` (the gradients found fp32), not silently: the run
would then keep fp32 gradients, as before.

When: only the caller knows whether the optimizer takes 16-bit gradients and whether gradients
are accumulated over micro-batches (they would then be added in 16 bits): the trainer decides
(trainer/fsdp2_trainer.py).
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def param_groups(model: nn.Module) -> list:
    """FSDP2's parameter groups of every unit of ``model`` (private state, marked above)."""
    groups = []
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            groups.extend(unit._get_fsdp_state()._fsdp_param_groups)  # private: see above
    return groups


def keep_reduce_dtype_grads(model: nn.Module) -> int:
    """Have FSDP2 leave ``model``'s gradient shards in its reduce dtype wherever that is not
    the parameters' dtype; returns the number of parameter groups it applies to."""
    groups = [g for g in param_groups(model)
              if g.mp_policy.reduce_dtype is not None and g.fsdp_params]
    for group in groups:
        for fsdp_param in group.fsdp_params:
            fsdp_param.sharded_param.grad_dtype = None  # a 16-bit .grad on an fp32 parameter

    def keep(*_):
        for group in groups:  # the policy's reduce dtype (FSDP2's own _reduce_dtype is None
            # when it equals the compute dtype: the gradients are already in it)
            reduce = group.mp_policy.reduce_dtype
            if group._orig_dtype != reduce:  # private: see above
                group._orig_dtype = reduce
    model.register_forward_pre_hook(keep)
    return len(groups)
