"""Adam stepped inside backward (``--fsdp2-step-in-backward``: optimizer/step_in_backward.py):
fairseq-train on 2 ranks with the flag against the same run without it.

Why bit for bit: each parameter's gradient shard is the one FSDP2 reduce-scatters either way;
the step in backward then does to it what fairseq's train_step does after backward, in the same
order with the same operations: multiply_grads by fairseq's factor (world size / the sample
size summed over the ranks, the same float64 value), the local norm grad_norm takes, and
fairseq's Adam (or the row-chunked step, with the random streams of the parameter's place),
which is elementwise per parameter. So the logged loss and gnorm of every update, the weights
and every tensor of the optimizer's state (moments, 8-bit block maxima, steps) agree exactly.

Equal runs alone would not show that the step ran in backward (a trainer that quietly stepped
after backward would equal the reference too): every run goes through tests/probes/
step_dtypes.py, which records at the start of fairseq's optimizer step (after backward) how
many gradients the step still finds: all of them without the flag, only the tied embedding's
with it (on 2 ranks its gradient is reduced by the tied early reduce, not by FSDP2: fairseq's
step after backward takes it).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import STEP_DTYPES, steps_seen, train_args_for
from launcher import ok, run_ranks
from numerics import per_update
import scenarios

FSDP2 = [*scenarios.FSDP2, "--clip-norm", "0"]
FLAG = "--fsdp2-step-in-backward"
#: 2 updates: the first steps from no stored moment, the second from the moments (and 8-bit
#: block maxima) the first stored, as every later update would; the step in backward's own state
#: across updates (its factor and norms, armed anew each update) is first reused at update 2
#: (tried by hand: the norms left uncleared from one update to the next fail at update 2)
UPDATES = 2
#: wide enough that the feed-forward weights (64 x 128) take 8-bit moments (4096 elements and
#: more), as test_adam_stats_8bit's WIDER
WIDER = ["--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
         "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128"]
#: every moment format the step in backward takes and both step paths: fairseq's own Adam (fp32
#: weights and moments), the row-chunked step with 16-bit gradient shards and their pending
#: factor (bf16 moments), and bf16 weights written back by stochastic rounding with 8-bit
#: moments (and float32 ones for the small parameters)
CASES = {"fp32": [],
         "bf16_grads_bf16_moments": ["--bf16", "--fsdp2-reduce-dtype", "bf16",
                                     "--bf16-adam-stats"],
         "bf16_weights_8bit_moments": ["--memory-efficient-bf16", "--eight-bit-adam-stats",
                                       *WIDER]}


def flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def train(corpus, save_dir: Path, *flags) -> tuple[str, dict, list]:
    """Rank 0's log, every tensor of the last checkpoint's shards (model and optimizer state,
    whole) and what each rank's optimizer steps found (conftest.steps_seen)."""
    results = run_ranks(2, lambda r: train_args_for(corpus, save_dir, *FSDP2, *flags,
                                                    updates=UPDATES, save=True), **STEP_DTYPES)
    out = ok(results)
    shards, = (save_dir / "fsdp2_shards").iterdir()
    whole = save_dir / "whole.pt"
    dcp_to_torch_save(shards, whole)
    return out, flat(torch.load(whole, weights_only=False)), steps_seen(results)


def differing(got: dict, want: dict) -> list[str]:
    assert got.keys() == want.keys()
    return [k for k in want if (not torch.equal(got[k], want[k]) if torch.is_tensor(want[k])
                                else got[k] != want[k])]


@pytest.mark.parametrize("case", list(CASES))
def test_step_in_backward_trains_bit_identical_to_the_step_after_it(case, corpus, tmp_path):
    flags = CASES[case]
    out, state, steps = train(corpus, tmp_path / "in_backward", *flags, FLAG)
    ref, ref_state, ref_steps = train(corpus, tmp_path / "after", *flags)
    assert "inside backward" in out and "inside backward" not in ref
    # the reference's every step finds every parameter's gradient; the step in backward left
    # only the tied embedding's (reduced by the tied early reduce, not by FSDP2) to fairseq's
    assert [[sum(s["grads"].values()) for s in rank] for rank in steps] == [[1] * UPDATES] * 2
    everything = sum(ref_steps[0][0]["grads"].values())
    assert everything > 50 and [[sum(s["grads"].values()) for s in rank]
                                for rank in ref_steps] == [[everything] * UPDATES] * 2
    got, want = per_update(out), per_update(ref)
    assert sorted(want) == list(range(1, UPDATES + 1)) and got == want
    assert not differing(state, ref_state), differing(state, ref_state)
    # what the case is for was there: optimizer state of every format it names
    dtypes = {v.dtype for k, v in ref_state.items() if torch.is_tensor(v) and ".exp_avg" in k}
    assert dtypes == {"fp32": {torch.float32}, "bf16_grads_bf16_moments": {torch.bfloat16},
                      "bf16_weights_8bit_moments": {torch.uint8, torch.float32}}[case], dtypes
    weights = {v.dtype for k, v in ref_state.items() if k.endswith("fc1.weight")
               and k.startswith("model.")}
    assert weights == {torch.bfloat16 if "--memory-efficient-bf16" in flags else torch.float32}


#: the options the step in backward's rule reads, each alone against a run it accepts (fp32,
#: Adam, --clip-norm 0, --update-freq 1): (label, flags, what the rule says: None, or the start
#: of its reason)
RULE_CASES = [
    ("accepted", [], None),
    ("bf16 with every accepted moment format", ["--bf16", "--eight-bit-adam-stats"], None),
    ("bf16 weights", ["--memory-efficient-bf16", "--bf16-adam-stats"], None),
    ("fp16 moments", ["--fp16", "--fp16-adam-stats"], "cannot step --fp16-adam-stats'"),
    ("clipping", ["--clip-norm", "1"], "needs --clip-norm 0, got 1:"),
    ("micro-batches", ["--update-freq", "2"], "needs --update-freq 1, got 2:"),
    ("fp16", ["--fp16"], "cannot be combined with --fp16:"),
    ("memory-efficient fp16", ["--memory-efficient-fp16"], "cannot be combined with --fp16:"),
    ("cpu offload", ["--cpu-offload"], "cannot be combined with --cpu-offload:"),
]


def test_the_run_the_check_and_the_estimator_decide_with_one_function(monkeypatch):
    """settings.step_in_backward_conflict decides for the trainer (optimizer/build.py's
    steps_in_backward), the check before training (its one line) and the estimator (its
    Setup, or the same line as its error): over each option the rule reads, all three agree
    with the rule's documented answer; with the function replaced, all three follow the
    replacement (a copy of the rule anywhere would keep its own answer). In-process: fairseq's
    parser and config, no model."""
    from test_settings import runtime_config  # fairseq-train's config, converted once

    from fairseq_fsdp2 import settings
    from fairseq_fsdp2.command_line import preflight
    from fairseq_fsdp2.errors import OptionError
    from fairseq_fsdp2.estimator import from_args
    from fairseq_fsdp2.optimizer.build import step_in_backward_conflict, steps_in_backward

    def decisions(flags):
        args = from_args.parse(["unused-data", "--task", "translation", "--vocab-size", "64",
                                "--arch", "transformer", "--max-tokens", "64", "--ddp-backend",
                                "fsdp2", "--optimizer", "adam", "--lr", "1e-4", "--clip-norm",
                                "0", FLAG, *flags])
        cfg = runtime_config(args, configs)
        try:
            preflight.check_options(cfg)
            refused = None
        except OptionError as e:
            refused = str(e)
        try:
            estimated = from_args.setup_for(args, 1).step_in_backward
        except OptionError as e:
            estimated = str(e)
        return step_in_backward_conflict(cfg), steps_in_backward(cfg), refused, estimated

    configs: dict = {}
    for label, flags, says in RULE_CASES:
        conflict, runs, refused, estimated = decisions(flags)
        if says is None:
            assert (conflict, runs, refused, estimated) == (None, True, None, True), label
        else:
            line = f"--fsdp2-step-in-backward {conflict}"
            assert conflict.startswith(says) and not runs, (label, conflict)
            assert refused == estimated == line, (label, refused, estimated)
    monkeypatch.setattr(settings, "step_in_backward_conflict", lambda *a: "replaced")
    assert decisions([]) == ("replaced", False, "--fsdp2-step-in-backward replaced",
                             "--fsdp2-step-in-backward replaced")
