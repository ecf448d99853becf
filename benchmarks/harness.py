"""What every benchmark shares: a synthetic corpus over NLLB's vocabulary, the fairseq-train
command line, one process per rank with torchrun's environment (each running worker.py), the
train_inner records they log, the machine and versions a report names, and replacing a marked
section of docs/benchmarks.md. The models are NLLB's layout, reduced or at 600M."""
from __future__ import annotations

import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

#: The repository: scripts/, docs/ (the reports' default place) and tests/probes/ are here.
ROOT = Path(__file__).resolve().parents[1]
PLUGIN = str(ROOT / "fairseq_fsdp2")
NLLB_VOCAB = 256_206
WORDS = 20  # words per sentence; + </s> = 21 tokens, source and target
SEQ = WORDS + 1

#: The NLLB layout (pre-norm, shared 256,206-entry embedding, sinusoidal positions, head dim 64)
#: at reduced size: 3+3 layers, dim 128, ffn 512.
REDUCED = ["--arch", "transformer_nllb_600m", "--encoder-layers", "3", "--decoder-layers", "3",
           "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
           "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
           "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
NLLB_600M = ["--arch", "transformer_nllb_600m"]

#: What each rank runs: worker.py. -P keeps the working directory off sys.path, so the ranks
#: import this checkout's package (PYTHONPATH, set by launch) wherever the script was started.
WORKER = [sys.executable, "-P", "-m", "benchmarks.worker"]


# -- data ------------------------------------------------------------------------------------

#: GNU time around each rank's command: the rank's maximum resident set, one line at its end
TIME = ["/usr/bin/time", "-f", "benchmark: max RSS %M KB"]
RSS = re.compile(r"benchmark: max RSS (\d+) KB")
KIB_PER_GIB = 2 ** 20


def peaks_gb(results: list[tuple[int, str]]) -> list[float]:
    """Each rank's maximum resident set in GiB (3 decimals), from the line TIME printed in its
    output (launch's results, run with ``wrapper=TIME``)."""
    peaks = []
    for _, out in results:
        found = RSS.findall(out)
        assert len(found) == 1, out[-2000:]
        peaks.append(round(int(found[0]) / KIB_PER_GIB, 3))
    return peaks


def make_corpus(root: Path, n_train: int) -> Path:
    """Random WORDS-word sentences over an NLLB-sized dictionary, binarized by fairseq."""
    out = root / "bin"
    if (out / "train.src-tgt.src.bin").exists():
        return out
    from fairseq_fsdp2.data.synthetic import write_random_corpus
    return write_random_corpus(root, vocab=NLLB_VOCAB, words=WORDS, n_train=n_train,
                               prefix="tok")


# -- running ---------------------------------------------------------------------------------

def train_args(data: Path, model: list[str], config: list[str], max_tokens: int, updates: int,
               save_dir: Path) -> list[str]:
    """fairseq-train's arguments: fp32 Adam, one record per update, no validation, no saving."""
    return [str(data), "--user-dir", PLUGIN, "--task", "translation", *model,
            "--optimizer", "adam", "--lr", "1e-4", "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--max-tokens", str(max_tokens),
            "--max-update", str(updates), "--log-format", "json", "--log-interval", "1",
            "--seed", "1", "--cpu", "--no-progress-bar", "--disable-validation", "--no-save",
            "--save-dir", str(save_dir), *config]  # a --criterion in config wins


def rank_args(args: list[str], config: list[str], rank: int, world: int) -> list[str]:
    """``args`` for one rank: legacy_ddp gets stock fairseq's multi-process CPU flags."""
    if "legacy_ddp" in config:
        return args + ["--distributed-world-size", str(world), "--distributed-rank", str(rank),
                       "--distributed-init-method", "env://", "--distributed-no-spawn",
                       "--distributed-backend", "gloo"]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, args_of_rank: Callable[[int], list[str]], timeout: float,
           preload: Sequence[str] = (), program: Optional[Sequence[str]] = None,
           wrapper: Sequence[str] = ()) -> list[tuple[int, str]]:
    """One process per rank with torchrun's environment; (returncode, output) per rank.

    Each rank runs ``program`` with ``args_of_rank(rank)``; by default the worker (worker.py),
    which imports the modules named in ``preload`` first (found on PYTHONPATH: a probe that
    patches fairseq's Trainer, say) and this checkout's package (put first on PYTHONPATH).
    ``wrapper``: a command each rank runs under (e.g. GNU time, measuring it from outside)."""
    if program is None:
        program = [*WORKER, *(f"--import={name}" for name in preload)]
        path = os.environ.get("PYTHONPATH", "")
        pythonpath = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p)}
    elif preload:
        raise ValueError("preload is for the worker; a program of its own imports what it needs")
    else:
        pythonpath = {}
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
                   PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), **pythonpath)
        procs.append(subprocess.Popen(
            [*wrapper, *program, *args_of_rank(rank)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    deadline = time.time() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n[benchmark] killed after {timeout}s"
        results.append((p.returncode, out))
    return results


class RankFailed(RuntimeError):
    """A rank of a benchmark's run did not exit 0."""


def failed_rank(results: list[tuple[int, str]]) -> Optional[tuple[int, str]]:
    """The (returncode, output) of the first rank of ``launch``'s results that did not exit 0."""
    return next(((rc, out) for rc, out in results if rc != 0), None)


def stop_if_a_rank_failed(results: list[tuple[int, str]], name: str = "") -> None:
    """Stop the benchmark (RankFailed, with the failed rank's exit code and the end of its
    output): the benchmark's script ends with it."""
    failed = failed_rank(results)
    if failed is not None:
        rc, out = failed
        raise RankFailed(f"{name + ': ' if name else ''}a rank exited {rc}:\n{out[-4000:]}")


def predicted(train: list[str], world: int):
    """The estimator's prediction (estimator.peak.Estimate) for fairseq-train's arguments
    ``train`` on ``world`` ranks, with the synthetic corpus's sentence length."""
    from fairseq_fsdp2.estimator.from_args import estimates, parse
    (prediction,) = estimates(parse(train + ["--world-size", str(world), "--seq-len", str(SEQ)]))
    return prediction


def worker(argv: list[str]) -> None:
    """Run fairseq-train; the stock Trainer gets the same per-rank memory log as FSDP2's."""
    import fairseq_cli.train
    from fairseq.trainer import Trainer

    from fairseq_fsdp2.memory.monitor import MemoryMonitor

    original = Trainer.train_step

    def train_step(self, samples, raise_oom=False):
        if type(self) is not Trainer:  # FSDP2Trainer logs its own memory
            return original(self, samples, raise_oom)
        if not hasattr(self, "_benchmark_memory"):
            self._benchmark_memory = MemoryMonitor(self.device, None,
                                                   rank=self.data_parallel_rank)
        out = original(self, samples, raise_oom)
        if out is not None and self.get_num_updates() % self.cfg.common.log_interval == 0:
            self._benchmark_memory.log(self.get_num_updates())
        return out

    Trainer.train_step = train_step
    sys.argv = ["fairseq-train", *argv]
    fairseq_cli.train.cli_main()


def parse_records(output: str) -> list[dict]:
    """fairseq's train_inner records (--log-format json) in a rank's output."""
    records = []
    for line in output.splitlines():
        if "train_inner" in line and "{" in line:
            records.append(json.loads(line[line.index("{"):]))
    return records


def available_gb() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2 ** 20
    return 0.0


# -- the report ------------------------------------------------------------------------------

def command_of(script: str, argv: Sequence[str]) -> str:
    """The command line a report records: ``.venv/bin/python scripts/x.py ARGS``."""
    return shlex.join([".venv/bin/python", script, *argv])


def versions() -> dict:
    """The machine and the versions a report names."""
    import fairseq
    import torch
    from importlib.metadata import version

    cpu, fields = "", {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's fields only
            fields.setdefault(key.strip(), value.strip())
        cpu = fields.get("model name", "")
        if "cpu family" in fields and "model" in fields:  # which generation: Zen 2/3/4/5, ...
            cpu += f", family {fields['cpu family']} model {fields['model']}"
    except OSError:
        pass
    mem = 0.0
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) / 2 ** 20
    return {"python": platform.python_version(), "torch": torch.__version__,
            "fairseq": version("fairseq-fixed") if _has("fairseq-fixed") else fairseq.__version__,
            "cores": os.cpu_count(), "memory_gib": round(mem, 1), "cpu": cpu,
            "machine": platform.machine()}


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def measured_or_saved(args, saved_name: str, measure: Callable[[Path, Path], dict]) -> dict:
    """What a benchmark reports: with --report-only FILE, what an earlier run saved there;
    else ``measure(data, work)`` on a corpus large enough for ``args``' updates, ranks and
    tokens (no epoch ends mid-benchmark), saved as WORK/``saved_name`` for --report-only."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        return json.loads(Path(args.report_only).read_text())
    sentences = args.updates * args.ranks * (args.max_tokens // SEQ) + 400
    saved = measure(make_corpus(work / f"corpus{sentences}", sentences), work)
    (work / saved_name).write_text(json.dumps(saved, indent=1))
    return saved


def replace_section(path: Path, begin: str, end: str, text: str) -> None:
    """Put ``text`` (which starts with ``begin`` and ends with ``end``) in place of that
    section of ``path``, or at its end."""
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        new = old[:old.index(begin)] + text + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + "\n\n" + text + "\n"
    path.write_text(new)


def ratio(x, y) -> str:
    return f"{x / y:.2f}x" if x and y else "-"
