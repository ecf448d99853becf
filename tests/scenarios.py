"""The scenarios of the compatibility tests (tests/test_fairseq_compat.py,
tests/test_fairseq_validation.py, tests/test_ema.py): one command line run with the plugin's
``--ddp-backend fsdp2`` (2 ranks) and with stock fairseq's own 2-rank ``legacy_ddp``, and the
readers of fairseq's logs that compare them.

Stock runs do not load the plugin (no ``--user-dir``), so a bug in its global patches cannot
cancel out of a comparison; only a stock run that reads the plugin's own checkpoint loads it.
Stateful features are also killed (SIGKILL, every rank, tests/probes/fault_point.py) and rerun
with the same command. Tolerances: tests/test_fairseq_compat.py's module docstring.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

import fairseq_fsdp2  # noqa: F401  (allow-lists the classes fairseq pickles for torch.load)

from conftest import PLUGIN, REPO, TINY_MODEL, TRAINING, stock_ddp
from launcher import finish_ranks, ok, run_ranks, start_ranks
from numerics import FP32_REORDERED, printed_close

#: --num-workers 0 (both backends): the batches are read in the rank's own process, in the same
#: order as by fairseq's default data-loader worker, which costs a process per rank and epoch;
#: and no wait for it at the end of a saved run (in the tests' forked ranks, a garbage
#: collection during rank 0's export shut the finished data loader down, which waited torch's
#: 5 s MP_STATUS_CHECK_INTERVAL for its worker)
NO_WORKER = ["--num-workers", "0"]
#: the plugin's backend, every layer a unit, batches read in the rank's process: the FSDP2 flags
#: of most test files
FSDP2 = ["--ddp-backend", "fsdp2", "--min-params-to-wrap", "1", *NO_WORKER]
PROBES = str(REPO / "tests" / "probes")
REL = FP32_REORDERED  # fsdp2 vs legacy_ddp, or another world size (test_fairseq_compat.py)


def flags_without(flags: list, *names: str,
                  valued: tuple = ("--max-tokens", "--log-format", "--user-dir", "--arch")):
    """``flags`` without the named options (and their values)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        if f in names:
            skip = f in valued
            continue
        out.append(f)
    return out


BASE = flags_without(TRAINING, "--max-tokens", "--log-format", "--disable-validation")


# --- reading fairseq's logs ----------------------------------------------------------------------

def updates(output: str) -> dict[int, tuple[str, str]]:
    """update -> (loss, gnorm) as printed, from --log-format json or simple."""
    found = {}
    for line in output.splitlines():
        if "| train_inner | " not in line:
            continue
        record = line.split("| train_inner | ", 1)[1]
        if record.startswith("{"):
            fields = json.loads(record)
        else:  # simple: "epoch 001:      3 / 8 loss=7.9, nll_loss=7.8, ..., num_updates=3"
            fields = dict(kv.split("=", 1) for kv in record.split(" / ", 1)[1].split(" ", 1)[1]
                          .split(", "))
        found[int(fields["num_updates"])] = (fields["loss"], fields["gnorm"])
    return found


def summary(output: str, tag: str = "train") -> dict[str, str]:
    """The last end-of-epoch summary: json, or ' | '-separated 'key value' (simple, tqdm)."""
    found = {}
    for line in output.splitlines():
        if f"| {tag} | " in line:
            record = line.split(f"| {tag} | ", 1)[1]
            found = json.loads(record) if record.startswith("{") else {
                f"{tag}_{k}": v for k, v in (p.split(" ", 1) for p in record.split(" | ")[1:])}
    return found


def valid_records(output: str) -> list[dict]:
    """fairseq's validation summaries (json), in order."""
    return [json.loads(line.split("| valid | ", 1)[1]) for line in output.splitlines()
            if "| valid | " in line]


def assert_same_training(ours: dict, stock: dict, rel: float = REL) -> None:
    """The same updates, each one's printed (loss, gnorm) within ``rel`` of the true values
    plus the printed rounding (module docstring)."""
    assert ours and sorted(ours) == sorted(stock), (sorted(ours), sorted(stock))
    for n in stock:
        for key, got, want in zip(("loss", "gnorm"), ours[n], stock[n]):
            assert printed_close(got, want, rel, key), (n, key, ours[n], stock[n])


def checkpoint_files(save_dir: Path) -> set[str]:
    return {p.name for p in save_dir.glob("checkpoint*.pt") if "consolidated" not in p.name}


class Scenario:
    """One command line, run under fsdp2 and under stock legacy_ddp (2 ranks each; the stock
    run on ``stock_ranks`` with ``stock_extra`` flags where given: 1 rank with --update-freq 2
    takes the 2 ranks' batches of each update). Stock runs go without the plugin:
    ``--user-dir`` dropped and, for a model the plugin names (``--arch
    transformer_nllb_tiny``), ``stock_model``: stock flags that build the same model."""

    def __init__(self, root: Path, args, name: str, stock_model: tuple = (),
                 stock_ranks: int = 2, stock_extra: tuple = ()):
        self.root, self.args, self.name, self.stock_model = root, args, name, list(stock_model)
        self.fsdp2 = self.run("fsdp2")
        self.stock = self.run("stock", *stock_extra, ranks=stock_ranks)

    def save_dir(self, label: str) -> Path:
        return self.root / f"{self.name}-{label}"

    def run(self, label: str, *extra, ranks: int = 2, fault: str | None = None,
            backend: str | None = None, without: tuple = (), plugin: bool | None = None,
            trusting: tuple = ()) -> str | list:
        """Run the scenario (``label`` names its save dir) with ``extra`` flags and ``without``
        some of its own; a run with a fault returns the results of the killed ranks, a normal
        run rank 0's output (every rank exited 0). ``plugin``: load the plugin (default: for
        the fsdp2 backend only; a stock run that reads the plugin's checkpoint needs it).
        ``trusting``: stock checkpoints a stock run without the plugin reads
        (tests/probes/stock_trusting.py)."""
        backend = backend or ("stock" if label.startswith("stock") else "fsdp2")
        plugin = backend == "fsdp2" if plugin is None else plugin
        assert plugin or backend == "stock", "the fsdp2 backend is the plugin"
        save = self.save_dir(label)

        def argv(rank):
            chosen = [*stock_ddp(rank, ranks), *NO_WORKER] if backend == "stock" else FSDP2
            own = flags_without([str(a) for a in self.args(save)], *without)
            if not plugin:
                own = flags_without(own, "--user-dir")
                if self.stock_model:
                    own = flags_without(own, "--arch") + self.stock_model
            return [*own, *chosen, *map(str, extra)]
        if fault is None:
            module, env = "fairseq_cli.train", None
            if trusting:
                module, env = "stock_trusting", {"PYTHONPATH": PROBES, "TRUSTED_CHECKPOINTS":
                                                 os.pathsep.join(map(str, trusting))}
            output = ok(run_ranks(ranks, argv, timeout=300, module=module, env=env))
            (self.root / f"{label}.log").write_text(output)  # kept for a failing test's reader
            return output
        pids = self.root / f"pids-{label}-{fault.replace(':', '-')}"
        pids.mkdir()
        results = finish_ranks(start_ranks(ranks, argv, module="fault_point", env={
            "PYTHONPATH": PROBES, "FAULT": fault, "FAULT_DIR": str(pids)}), 300)
        assert all(r.returncode != 0 for r in results), results[0].output[-3000:]
        return results


def shard_tensors(checkpoint_file: Path, out: Path) -> dict:
    """Every tensor a sharded checkpoint's shards hold (model and optimizer), read whole in
    this process (DCP's public converter to a torch.save file, written to ``out``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    header = torch.load(checkpoint_file, weights_only=True)["fsdp2"]
    shards = checkpoint_file.parent / header["shards"]
    dcp_to_torch_save(shards, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif torch.is_tensor(value):
            flat[prefix] = value
    walk("", torch.load(out, weights_only=True))
    return flat


def is_adam_moment(key: str) -> bool:
    """Whether a sharded checkpoint's key (DCP's flat name, as shard_tensors and the shards'
    metadata give it) is one of Adam's two moments, in whatever format it was saved (its
    scales and fairseq's other optimizer state excluded)."""
    return key.startswith("optim.state.") and key.endswith((".exp_avg", ".exp_avg_sq"))


def resumed_at(output: str) -> int:
    found = re.search(r"Loaded checkpoint .* \(epoch \d+ @ (\d+) updates\)", output)
    return int(found.group(1)) if found else 0


def assert_resumed_exactly(made: dict, uninterrupted: dict, first: int,
                           last: int | None = None) -> None:
    """The resumed run made every update from ``first`` to ``last`` (default: the uninterrupted
    run's last; a run killed again stops before), none missing, none more, each equal to the
    uninterrupted run's update bit for bit."""
    last = max(uninterrupted) if last is None else last
    assert sorted(made) == list(range(first, last + 1)), (sorted(made), first, last)
    for n, value in made.items():
        assert value == uninterrupted[n], f"update {n}: {value} != {uninterrupted[n]}"


def tiny_model_scenario(corpus, tmp_path_factory, name: str, flags: list) -> Scenario:
    def args(save):
        return [corpus, "--user-dir", PLUGIN, *TINY_MODEL, *BASE, *flags, "--save-dir", save]
    return Scenario(tmp_path_factory.mktemp(name), args, name)
