"""The optimizer's elementwise work on the local shards (fairseq_fsdp2/optimizer/local_shard_step.py) computes
exactly what DTensor dispatch computes: 2 real gloo ranks, uneven shards, 4 steps with
gradient scaling, clipping, weight decay, and fairseq's fp16 loss-scaling wrapper; Adam's moments
in float32, and in 16 or 8 bits between steps (optimizer/adam_stats.py)."""
from __future__ import annotations

import json

import pytest

from conftest import REPO
from launcher import ok, run_ranks

PROBES = str(REPO / "tests" / "probes")


@pytest.fixture(scope="module")
def report():
    out = ok(run_ranks(2, lambda r: [], module="local_shards_probe", env={"PYTHONPATH": PROBES}))
    return json.loads(next(line for line in out.splitlines() if line.startswith("PROBE "))[6:])


#: the moments' dtypes (8 bits: the weights' codes; the biases keep float32)
MOMENT_DTYPES = {"fp32": ["torch.float32"], "fp16_wrapper": ["torch.float32"],
                 "fp16_adam_stats": ["torch.float16"], "bf16_adam_stats": ["torch.bfloat16"],
                 "eight_bit_adam_stats": ["torch.float32", "torch.uint8"]}


@pytest.mark.parametrize("case", list(MOMENT_DTYPES))
def test_local_shard_step_is_bit_identical_to_dtensor_dispatch(report, case):
    r = report[case]
    assert r["local_path"] and r["class_name"] == "Adam"  # the path under test was taken
    assert not r["reference_local_path"]  # and the reference is DTensor dispatch throughout
    assert r["params_moved"] > 1e-3  # 4 Adam steps at lr 1e-2 moved every tensor
    # the same aten operations on the same local tensors: equal bit for bit, no tolerance
    assert r["param_max_diff"] == 0.0
    assert r["state_keys_equal"] and r["state_max_diff"] == 0.0
    assert r["state_steps"] == [4]
    # the state stays DTensors laid out like their parameters (what checkpoints reshard)
    assert r["state_is_dtensor"]
    # in the format asked for; fp16 moments with fairseq's scales beside them
    assert r["state_dtypes"] == MOMENT_DTYPES[case]
    scales = {"exp_avg_scale", "exp_avg_sq_scale"}
    assert scales <= set(r["state_keys"]) if case == "fp16_adam_stats" else \
        not scales & set(r["state_keys"])


def test_non_elementwise_optimizers_keep_the_dtensor_path(report):
    # Adafactor's factored second moment needs whole rows and columns of each parameter
    assert report["adafactor_local_path"] is False
