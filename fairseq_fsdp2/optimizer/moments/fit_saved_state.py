"""Fitting the destination of a DCP load of Adam's state to what the checkpoint holds: the
moments in their saved format (float32, 16 bits with or without fairseq's scales, 8 bits with
block maxima), whatever this run's flag, so that the run converts them at its next step."""
from __future__ import annotations

import torch

from . import FORMATS
from .format import MOMENTS


def fit_to_saved(optimizer_state: dict, saved: dict, prefix: str = "optim.state.") -> None:
    """Make ``optimizer_state`` (``get_optimizer_state_dict``'s, parameters by name), the
    destination of a DCP load, hold what the checkpoint holds: each moment in its saved dtype,
    each format's side tensor where the checkpoint has one (fp16's scale; 8 bits' block maxima,
    laid out like the parameter's rows); so that a run resumed with or without a 16-bit or 8-bit
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
            for fmt in FORMATS.values():
                side_key = fmt.side_key(key)
                if side_key is None:
                    continue
                if f"{prefix}{name}.{side_key}" not in saved:
                    per_param.pop(side_key, None)
                elif not torch.is_tensor(per_param.get(side_key)):
                    per_param[side_key] = fmt.placeholder(value)
