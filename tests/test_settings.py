"""One decision, one place (fairseq_fsdp2/settings.py): Adam's moment format, whether the
gradient shards stay in the 16-bit reduce dtype, whether Adam steps a chunk of rows at a
time and whether the weights are kept in bf16 (--memory-efficient-bf16) are decided by the same
functions for the run (the trainer and the optimizer) and for the estimator, over every
combination of the options they depend on; and estimator/ states neither rule itself.

In-process and cheap: fairseq's parser, the trainer's config, and the optimizer built over one
small tensor; no model, no training.
"""
from __future__ import annotations

import ast
import copy
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import DictConfig, open_dict

from fairseq_fsdp2 import settings
from fairseq_fsdp2.estimator import from_args
from fairseq_fsdp2.estimator.ledger import row_chunked
from fairseq_fsdp2.optimizer.adam_stats import FORMAT_OF
from fairseq_fsdp2.optimizer.build import build_optimizer, keeps_bf16_weights
from fairseq_fsdp2.trainer.fsdp2_trainer import FSDP2Trainer

ESTIMATOR = Path(from_args.__file__).parent
#: the compute precision and the reduce dtypes training accepts with it (options.py)
PRECISIONS = {"fp32": ([], ["fp32"]), "bf16": (["--bf16"], ["fp32", "bf16"]),
              "fp16": (["--fp16"], ["fp32", "fp16"]),
              "bf16 weights": (["--memory-efficient-bf16"], ["fp32", "bf16"])}
MOMENTS = {"fp32": [], "fp16": ["--fp16-adam-stats"], "bf16": ["--bf16-adam-stats"],
           "8bit": ["--eight-bit-adam-stats"]}
#: the config groups fairseq-train's cfg takes the command line's values into
GROUPS = ("common", "distributed_training", "optimization", "optimizer")


def command_lines():
    """Every combination of the options the two decisions read: (label, argv, amsgrad).
    amsgrad has no command-line flag (fairseq's Adam takes it as a parameter-group option):
    it is set on the parsed arguments and on the optimizer's groups alike."""
    for optimizer in ("adam", "adafactor"):
        for precision, (flags, reduces) in PRECISIONS.items():
            for reduce, moments, freq, offload, wide, amsgrad in itertools.product(
                    reduces, MOMENTS, ("1", "2"), (False, True), (False, True), (False, True)):
                if optimizer != "adam" and (moments != "fp32" or amsgrad):
                    continue  # Adam's options only
                if precision == "bf16 weights" and amsgrad:
                    # amsgrad has no flag: the config the trainer decides bf16 weights from
                    # (before any optimizer exists) never holds it
                    continue
                argv = ["unused-data", "--task", "translation", "--vocab-size", "64",
                        "--arch", "transformer", "--max-tokens", "64", "--ddp-backend", "fsdp2",
                        "--optimizer", optimizer, "--lr", "1e-4", *flags,
                        "--fsdp2-reduce-dtype", reduce, *MOMENTS[moments], "--update-freq", freq,
                        *(["--cpu-offload"] if offload else []),
                        *(["--fsdp2-fp32-grad-shards"] if wide else [])]
                label = (f"{optimizer} {precision} reduce {reduce} moments {moments} "
                         f"update-freq {freq} cpu-offload {offload} fp32-grad-shards {wide} "
                         f"amsgrad {amsgrad}")
                yield label, argv, amsgrad


def parsed(argv, amsgrad: bool, parses: Optional[dict] = None):
    """``argv`` parsed (once per command line in ``parses``: amsgrad, which has no flag, set on
    a copy)."""
    if parses is None or tuple(argv) not in parses:
        args = from_args.parse(argv)
        if parses is None:
            args.amsgrad = amsgrad
            return args
        parses[tuple(argv)] = args
    args = copy.copy(parses[tuple(argv)])
    args.amsgrad = amsgrad
    return args


def runtime_config(args, cfgs: dict):
    """fairseq-train's config of ``args``: converted once per optimizer (hydra's compose is
    slow), then each field the command line sets taken from ``args``, as the conversion does
    (test_the_runtime_config_is_fairseqs checks it)."""
    if args.optimizer not in cfgs:
        cfgs[args.optimizer] = convert_namespace_to_omegaconf(args)
    cfg = cfgs[args.optimizer]
    for group in GROUPS:
        node = cfg[group]
        if not isinstance(node, DictConfig):  # fairseq keeps some optimizers' as a Namespace
            for key in vars(node):
                setattr(node, key, getattr(args, key, getattr(node, key)))
            continue
        with open_dict(node):
            for key in list(node):
                if hasattr(args, key) and node[key] != getattr(args, key):
                    node[key] = getattr(args, key)
    return cfg


def runtime_decisions(cfg, amsgrad: bool):
    """What the run decides: the trainer whether its gradient shards stay 16-bit (as
    _build_optimizer asks it) and whether its weights are bf16 (as _shard asks it), the
    optimizer (built by ``build``: it is told the latter) whether its step is row-chunked given
    them (``decide``, given the optimizer: amsgrad set on its groups)."""
    def build():
        return build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2, 2))])

    def decide(wrapped):
        inner = wrapped.optimizer  # the torch optimizer (under fairseq's fp16 wrapper too)
        for group in inner.param_groups:
            group["amsgrad"] = amsgrad
        moments = FORMAT_OF[inner.moment_dtype] if hasattr(inner, "moment_dtype") else "fp32"
        keeps = FSDP2Trainer._keeps_16_bit_grads(SimpleNamespace(cfg=cfg, _optimizer=wrapped))
        steps = getattr(inner, "steps_in_row_chunks", None)  # Adam's step only
        return moments, keeps, steps is not None and steps(keeps), keeps_bf16_weights(cfg)
    return build, decide


def built_consulting(build, functions: dict) -> tuple[object, set]:
    """``build()``, and the names of the settings ``functions`` it called."""
    consulted: set = set()

    def recording(name, function):
        def record(*args, **kwargs):
            consulted.add(name)
            return function(*args, **kwargs)
        return record
    with pytest.MonkeyPatch.context() as patch:
        for name, function in functions.items():
            patch.setattr(settings, name, recording(name, function))
        return build(), consulted


def estimator_decisions(args):
    setup = from_args.setup_for(args, 2)
    return setup.adam_stats, setup.narrow_grads, row_chunked(setup), setup.bf16_weights


@pytest.fixture(scope="module")
def cfgs() -> dict:
    """fairseq-train's config converted once per optimizer for the module (runtime_config)."""
    return {}


def negated(function):
    return lambda *a, **k: not function(*a, **k)


def test_the_run_and_the_estimator_decide_with_the_same_functions(monkeypatch, cfgs):
    """For every combination: the estimator's decisions (moment format, 16-bit gradient shards,
    row-chunked step) equal the run's; with a settings
    function replaced (its answer negated), both sides still agree, and the decision it makes
    follows it on both sides: each side's answer is that function's output, not a copy of the
    rule (a copy, even one that agrees today, keeps its own answer and is caught).

    The optimizer is built anew with the function negated where its build calls that function;
    otherwise the one built before serves (a build that never calls it cannot differ). amsgrad
    has no flag: its two values share a command line, a config and so the optimizers built."""
    parses: dict = {}
    built: dict = {}  # (command line, the function negated or None) -> (optimizer, consulted)
    real = {name: getattr(settings, name) for name in
            ("step_takes_16_bit_grads", "keeps_16_bit_grads", "row_chunked_step",
             "keeps_bf16_weights")}
    seen = set()
    for label, argv, amsgrad in command_lines():
        args = parsed(argv, amsgrad, parses)
        build, decide = runtime_decisions(runtime_config(args, cfgs), amsgrad)
        if (tuple(argv), None) not in built:
            built.clear()
            built[tuple(argv), None] = built_consulting(build, real)
        optimizer, consulted = built[tuple(argv), None]
        truth = decide(optimizer)
        assert estimator_decisions(args) == truth, label
        seen.add(truth[1:])
        if args.optimizer != "adam":
            continue  # no row-chunked step to redirect
        for name, function in real.items():
            monkeypatch.setattr(settings, name, negated(function))
            if name in consulted and (tuple(argv), name) not in built:
                built[tuple(argv), name] = build(), None
            runtime = decide(built[tuple(argv), name][0] if name in consulted else optimizer)
            estimated = estimator_decisions(args)
            monkeypatch.setattr(settings, name, function)
            assert estimated == runtime, f"{label}: {name} negated"
            if name == "keeps_16_bit_grads":
                assert runtime[1] != truth[1], label
            if name == "row_chunked_step":
                assert runtime == (*truth[:2], not truth[2], truth[3]), label
            if name == "keeps_bf16_weights":
                assert runtime[3] != truth[3], label
    # every outcome occurs: neither, the row-chunked step alone, both (16-bit gradients are
    # only kept for a step that takes them); bf16 weights with a row-chunked step, with and
    # without 16-bit gradient shards kept
    assert seen == {(False, False, False), (False, True, False), (True, True, False),
                    (False, True, True), (True, True, True)}


def test_the_runtime_config_is_fairseqs(cfgs):
    """runtime_config's field copy gives what fairseq's conversion gives, for the combination
    that changes the most fields from the first one converted (the module's conversion of
    Adam's first command line: made here where the test above did not make it, else copied
    from the last one it decided, back to the first, then to this one)."""
    lines = [(argv, amsgrad) for _, argv, amsgrad in command_lines() if "adam" in argv]
    runtime_config(parsed(*lines[0]), cfgs)
    args = parsed(*lines[-1])
    fresh = convert_namespace_to_omegaconf(args)
    copied = runtime_config(args, cfgs)
    for group in GROUPS:
        assert copied[group] == fresh[group], group


#: what only these decisions read: an estimator module that reads one outside a call to a
#: settings function states the rule again
RULE_INPUTS = {"amsgrad", "fsdp2_fp32_grad_shards"}


def restatements(tree: ast.AST) -> list[int]:
    """Lines where a decision's own input is read outside a ``settings.*(...)`` call (a copy
    into a field of the estimator's Setup, ``amsgrad=...``, is a read, not a rule), or where
    --update-freq is compared with ``[1]``."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def inside_settings_call_or_field(node):
        while node in parents:
            parent = parents[node]
            if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute) and \
                    isinstance(parent.func.value, ast.Name) and parent.func.value.id == "settings":
                return True
            if isinstance(parent, ast.keyword) and parent.arg in RULE_INPUTS:
                return True
            if isinstance(parent, (ast.BoolOp, ast.UnaryOp, ast.Compare, ast.IfExp, ast.If)):
                return False
            node = parent
        return False
    found = []
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else \
            node.value if isinstance(node, ast.Constant) else None
        if name in RULE_INPUTS and not inside_settings_call_or_field(node):
            found.append(node.lineno)
        if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.List) and len(c.elts) == 1 and
                isinstance(c.elts[0], ast.Constant) and c.elts[0].value == 1
                for c in [node.left, *node.comparators]):
            found.append(node.lineno)
    return sorted(found)


def test_the_estimator_states_no_rule_of_these_decisions():
    found = {path.name: lines for path in sorted(ESTIMATOR.glob("*.py"))
             if (lines := restatements(ast.parse(path.read_text())))}
    assert not found, f"settings.py decides these; estimator/ restates them at {found}"


@pytest.mark.parametrize("source, lines", [
    # the copy this module replaced (from_args.narrow_grads_of, as it was)
    ("def f(args):\n    return not getattr(args, 'amsgrad', False) and \\\n"
     "        list(args.update_freq or [1]) == [1]\n", [2, 3]),
    ("def f(s):\n    return s.optimizer == 'adam' and not s.amsgrad\n", [2]),
    ("def f(args):\n    return settings.keeps_16_bit_grads(args.fsdp2_fp32_grad_shards)\n", []),
    ("def f(args):\n    return Setup(amsgrad=bool(getattr(args, 'amsgrad', False)))\n", []),
])
def test_restatements_are_found(source, lines):
    assert restatements(ast.parse(source)) == lines
