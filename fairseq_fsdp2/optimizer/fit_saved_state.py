"""Fitting the destination of a DCP load of Adam's state to what the checkpoint holds: the
moments in their saved format (float32, 16 bits with or without fairseq's scales, 8 bits with
block maxima: adam_stats.py), whatever this run's flag, so that the run converts them at its
next step."""
from __future__ import annotations

import torch

from ..sharding.mesh import local_part
from .adam_stats import ABSMAX_KEYS, MOMENTS, SCALE_KEYS
from .blockwise_8bit import absmax_shape, rows_like


def fit_to_saved(optimizer_state: dict, saved: dict, prefix: str = "optim.state.") -> None:
    """Make ``optimizer_state`` (``get_optimizer_state_dict``'s, parameters by name), the
    destination of a DCP load, hold what the checkpoint holds: each moment in its saved dtype,
    a scale where the checkpoint has one (fp16), block maxima where it has them (8 bits: laid
    out like the parameter's rows); so that a run resumed with or without a 16-bit or 8-bit
    flag reads the other format's state as it was (its next step converts it). ``saved``: the
    checkpoint's flattened keys (``PREFIX<name>.<key>``) -> the saved tensor's dtype."""
    for name, per_param in optimizer_state.get("state", {}).items():
        for key in MOMENTS:
            value, stored = per_param.get(key), f"{prefix}{name}.{key}"
            if not torch.is_tensor(value) or stored not in saved:
                continue
            dtype = saved[stored]
            if dtype is not None and dtype != value.dtype:
                per_param[key] = value.to(dtype)
            scale_key = SCALE_KEYS[key]
            if f"{prefix}{name}.{scale_key}" not in saved:
                per_param.pop(scale_key, None)
            elif not torch.is_tensor(per_param.get(scale_key)):
                per_param[scale_key] = torch.ones((), device=local_part(value).device)
            absmax_key = ABSMAX_KEYS[key]  # 8 bits: the block maxima, sharded like the rows
            if f"{prefix}{name}.{absmax_key}" not in saved:
                per_param.pop(absmax_key, None)
            elif not torch.is_tensor(per_param.get(absmax_key)):
                local = local_part(value)
                per_param[absmax_key] = rows_like(torch.zeros(
                    (local.shape[0], absmax_shape(value.shape)[1]), device=local.device), value)
