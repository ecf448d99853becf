"""The memory estimator's step of fairseq's stock legacy_ddp on one rank, on the same ledger as
FSDP2's (fsdp2_step.py): every rank holds the whole model, its gradients and optimizer state."""
from __future__ import annotations

import math

from ..criterions.fused import chunk_bytes
from .ledger import Ledger, Setup, optimizer_state_bytes, step_temporary_bytes
from .model_profile import ModelProfile


def simulate_ddp(profile: ModelProfile, setup: Setup) -> Ledger:
    """fairseq's stock legacy_ddp: every rank holds the whole model, its gradients and state."""
    c = profile.compute_bytes
    work, trace = profile.workload, profile.trace_for(setup.device)
    T, V, d = work.tokens, profile.vocab, profile.embed_dim
    P = profile.total_params
    mixed = c != 4
    led = Ledger()
    led.add("gathered", P * c)  # the full model on every rank
    master = mixed and not setup.memory_efficient_fp16
    if master:
        led.add("sharded", P * 4)  # fairseq's FP16Optimizer: fp32 master copy
    led.add("optim", optimizer_state_bytes(setup, P))
    led.add("ema", P * setup.ema_bytes)  # fairseq's EMA: a copy of the whole model
    led.add("other", profile.buffer_bytes)
    if setup.world_size > 1:
        led.add("comm", P * c)  # LegacyDistributedDataParallel's all-reduce buffer
    if master:
        led.add("grads", P * 4)  # the fp32 master gradients, kept between steps
    float_copy = 4 if mixed else 0
    for kind, value in trace.events:
        if kind == "act":
            led.add("acts", value)
    led.moment("end of forward")
    new = V * d * c  # one dense gradient of the tied weight
    if setup.loss_chunk_tokens <= 0:
        led.moment("loss forward: logits and log-probabilities", loss=T * V * (c + float_copy + 4))
        led.moment("loss backward: log-softmax gradient", loss=3 * T * V * 4)
        led.moment("backward: output projection", loss=T * V * c, grads=new, acts=T * d * c)
        led.add("grads", new)
    else:  # the fused chunked loss; fairseq's own trainer passes no fp16 loss scale, so an
        # fp16 model's loss gradients are float32, computed against a float32 copy of the weight
        n = min(setup.loss_chunk_tokens, T)
        g = 4 if setup.precision == "fp16" else c
        weight_copy = V * d * 4 if setup.precision == "fp16" else 0
        led.add("loss", T * d * (c + g))  # the features and their gradient
        chunk = chunk_bytes(n, V, c, g) + weight_copy
        led.moment("loss forward: one chunk", loss=chunk, grads=V * d * g)
        led.add("grads", V * d * g)
        led.sub("loss", T * d * (c + g))
    accumulated = setup.loss_chunk_tokens > 0
    for kind, value in reversed(trace.events):
        if kind == "act":
            led.sub("acts", value)
        elif kind == "exit" and value in profile.layer_params:
            led.moment(f"backward: {value}",
                       acts=2 * trace.max_act.get(value, 0) + T * d * c)
        elif kind == "enter" and value in profile.layer_params:
            n_params = profile.layer_params[value]
            led.moment(f"backward: {value} gradients", grads=n_params * c, acts=2 * T * d * c)
            led.add("grads", n_params * c)
        elif kind == "enter" and value in profile.embed_paths:
            extra = V * d * c if accumulated else 2 * V * d * c
            led.moment(f"backward: {value} (embedding gradient)", grads=extra)
            accumulated = True
    rest = P * c - V * d * c - sum(profile.layer_params.values()) * c
    led.add("grads", max(rest, 0))
    largest = max(math.prod(s) for u in profile.units for s in u.shapes)
    led.moment("optimizer step", optim=step_temporary_bytes(setup, largest, P, buckets=False))
    return led
