"""Shared fixtures: the tiny binarized corpus and the tiny model's fairseq-train flags."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import pytest

from launcher import close_fork_server

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))

PLUGIN = str(REPO / "fairseq_fsdp2")

#: Test-only packages (requirements-dev.txt: transformers, tensorboard, fairscale), installed by
#: scripts/setup.sh into .venv/fixture-deps, on no default path; another folder for a checkout
#: whose .venv is shared and not its own to install into.
FIXTURE_DEPS = Path(os.environ.get("FAIRSEQ_FSDP2_FIXTURE_DEPS", Path(sys.prefix) / "fixture-deps"))
#: Set to 1 by scripts/test.sh: there a missing test-only package fails the tests that need it
#: (the suite is incomplete without them); elsewhere (a bare pytest) they are skipped, saying why.
REQUIRE_FIXTURE_DEPS = "FAIRSEQ_FSDP2_REQUIRE_FIXTURE_DEPS"


def need_fixture_dep(package: str, purpose: str) -> Path:
    """FIXTURE_DEPS if it holds ``package``; else skip the test, or fail it under
    scripts/test.sh (REQUIRE_FIXTURE_DEPS)."""
    if (FIXTURE_DEPS / package).is_dir():
        return FIXTURE_DEPS
    message = f"no {package} in {FIXTURE_DEPS} {purpose}: run scripts/setup.sh"
    if os.environ.get(REQUIRE_FIXTURE_DEPS) == "1":
        pytest.fail(f"{message} ({REQUIRE_FIXTURE_DEPS}=1: scripts/test.sh runs the whole "
                    "suite)", pytrace=False)
    pytest.skip(message)

#: A 2+2-layer transformer with shared embeddings: ~46k parameters, trains in seconds.
TINY_MODEL = [
    "--task", "translation", "--arch", "transformer", "--share-all-embeddings",
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--encoder-normalize-before", "--decoder-normalize-before", "--dropout", "0.1",
]
TRAINING = [
    "--optimizer", "adam", "--lr", "1e-3", "--clip-norm", "1.0",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "500", "--log-format", "json", "--log-interval", "1", "--seed", "1",
    "--cpu", "--no-progress-bar", "--disable-validation",
]
STOCK_DDP = ["--ddp-backend", "legacy_ddp", "--distributed-init-method", "env://",
             "--distributed-no-spawn", "--distributed-backend", "gloo"]


#: Test files, longest first (seconds of `pytest --durations=0`, summed per file, in a suite run
#: of two workers, 2026-12-06 at cb38026 with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2:
#: 61 s for test_backend.py down to 5 s for test_layout.py). scripts/test.sh runs two pytest-xdist
#: workers that take whole files in collection order (--dist loadfile --no-loadscope-reorder):
#: longest first, no worker is left alone with a long file at the end. Files not listed (under
#: 5 s each) come after, in pytest's order. The order changes nothing but which worker runs
#: what when.
LONGEST_FIRST = [
    "test_backend.py", "test_bad_input.py", "test_faults.py", "test_checkpoints.py",
    "test_fairseq_compat.py", "test_estimate.py", "test_fairseq_validation.py",
    "test_launchers.py", "test_nllb_finetune.py", "test_adam_stats_8bit.py", "test_evaluate.py",
    "test_ema.py", "test_lora.py", "test_quiet.py", "test_bf16_weights.py", "test_gpu_check.py",
    "test_in_process.py", "test_chunked_loss.py", "test_end_of_run.py", "test_hf_nllb.py",
    "test_other_tasks.py", "test_predicted_tables.py", "test_step_in_backward.py",
    "test_narrow_grads.py", "test_gloo_comms.py", "test_memory_breakdown.py",
    "test_grown_embedding.py", "test_estimate_rules.py", "test_hub.py",
    "test_legacy_fairscale.py", "test_hf_add_langs.py", "test_settings.py",
    "test_tied_early_reduce.py", "test_layout.py",
]


def pytest_collection_modifyitems(items) -> None:
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # a stable sort: each file's tests stay together and in their own order
    items.sort(key=lambda item: place.get(Path(str(item.fspath)).name, len(place)))


#: AF_UNIX socket paths (multiprocessing's listener in pymp-*/, the fork server's) must stay
#: under 108 bytes: a longer session directory is not used as the temporary directory.
SHORT_TMPDIR = 60


@pytest.fixture(scope="session", autouse=True)
def temporary_files_in_the_session_dir(tmp_path_factory):
    """Every process the suite starts writes its temporary files under this session's pytest
    directory, which pytest prunes (it keeps the last 3 sessions), instead of leaving them in
    the system's: a DataLoader worker that passed a tensor's file descriptor (multiprocessing's
    resource sharer) is terminated at exit before it removes its pymp-* directory, in stock
    fairseq runs as in the plugin's (one per rank and run, measured with --ddp-backend
    legacy_ddp too), and killed torchrun agents leave their torchelastic_* directories: about
    130 directories per suite run otherwise."""
    tmp = tmp_path_factory.getbasetemp() / "tmp"
    if len(str(tmp)) > SHORT_TMPDIR:
        yield
        return
    tmp.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp))  # the processes the tests start
        patch.setattr(tempfile, "tempdir", str(tmp))  # this one's (gettempdir() caches)
        yield


@pytest.fixture(scope="session", autouse=True)
def fork_server_waited_for():
    """At the session's end, its fork server (tests/launcher.py) ends and is waited for: the
    CPU time of every rank it forked then counts in this process's children's, as
    scripts/benchmark_suite.py measures the suite."""
    yield
    close_fork_server()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    # imported here, not at the top: corpus.py imports fairseq and torch (5 s of CPU on 2
    # cores), which pytest-xdist's controller, loading this file before it starts the workers
    # and running no test itself, would otherwise import while both cores wait
    from corpus import make_corpus
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def train_args_for(corpus: Path, save_dir: Path, *extra, save=False, updates=10,
                   plugin=True) -> list[str]:
    """fairseq-train arguments for the tiny model; add the backend and run-specific flags.
    ``plugin=False``: without ``--user-dir``, for stock fairseq's reference runs (the plugin's
    global patches must not run on both sides of a comparison, where a bug would cancel out)."""
    args = [str(corpus), *(["--user-dir", PLUGIN] if plugin else []), *TINY_MODEL, *TRAINING,
            "--max-update", str(updates), "--save-dir", str(save_dir)]
    if not save:
        args.append("--no-save")
    return args + [str(a) for a in extra]


def nllb_tiny_train_args(data: Path, save_dir: Path, *extra,
                         lang_pairs: Optional[str] = None) -> list[str]:
    """fairseq-train arguments for the plugin's tiny NLLB (transformer_nllb_tiny) on one rank,
    on data prepared by scripts/prepare_data.sh, as the recipe trains it (NLLB's task, language
    tags); ``lang_pairs``: its --lang-pairs, else DATA/lang_pairs.txt's."""
    return [str(a) for a in [
        data, "--user-dir", PLUGIN, "--ddp-backend", "fsdp2", "--min-params-to-wrap", 1,
        "--task", "translation_multi_simple_epoch", "--arch", "transformer_nllb_tiny",
        "--lang-pairs", lang_pairs or (data / "lang_pairs.txt").read_text().strip(),
        "--langs", (data / "langs.txt").read_text().strip(),
        "--encoder-langtok", "src", "--decoder-langtok", "--optimizer", "adam",
        "--lr", "3e-3", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--max-tokens", 2000, "--seed", 1, "--cpu",
        "--num-workers", 0, "--disable-validation", "--no-epoch-checkpoints",
        "--no-progress-bar", "--save-dir", save_dir, *extra]]


@pytest.fixture
def train_args(corpus, tmp_path):
    """train_args_for with a save dir of the test's own (tmp_path/ckpt)."""
    def build(*extra, save=False, updates=10):
        return train_args_for(corpus, tmp_path / "ckpt", *extra, save=save, updates=updates)
    return build


def other_rounding_draws() -> dict:
    """run_ranks' keywords for a fairseq-train run whose stochastic rounding of Adam's moments
    draws other numbers (tests/probes/other_rounding_draws.py): the twin of a run, for
    numerics.assert_within_noise."""
    return {"module": "other_rounding_draws",
            "env": {"PYTHONPATH": str(REPO / "tests" / "probes")}}


#: run_ranks' keywords for a fairseq-train run that prints, at every optimizer step on every
#: rank, its gradients' kinds and the dtypes they were reduced in (tests/probes/step_dtypes.py)
STEP_DTYPES = {"module": "step_dtypes", "env": {"PYTHONPATH": str(REPO / "tests" / "probes")}}


def steps_in(output: str, rank: int = 0) -> list[dict]:
    """Each optimizer step's record in one rank's output (a run through STEP_DTYPES):
    {"grads": {"DTensor torch.bfloat16": count, ...}, "reduced": {"torch.bfloat16": count}}."""
    prefix = "step dtypes: "
    steps = [json.loads(line.split(prefix, 1)[1]) for line in output.splitlines()
             if line.startswith(prefix)]
    assert all(s.pop("rank") == rank for s in steps), output[-2000:]
    return steps


def steps_seen(results) -> list[list[dict]]:
    """steps_in, per rank of run_ranks' results."""
    return [steps_in(r.output, r.rank) for r in results]


def stock_ddp(rank: int, world: int) -> list[str]:
    """Stock fairseq's own multi-process CPU flags (see the platform notes)."""
    return STOCK_DDP + ["--distributed-world-size", str(world), "--distributed-rank", str(rank)]


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at ``path`` (created) for the ``with`` block: a small disk that fills, or
    a read-only file system (the tests run as root, whom chmod does not stop). Skips the test
    where mounting is not permitted (it needs root or CAP_SYS_ADMIN)."""
    path.mkdir(exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


#: fairseq-generate's length limit for the tiny corpus (corpus.py: sentences of 3 to 12 words,
#: a translation as long as its source): 20 tokens hold every whole translation and its </s>.
#: Without it a model trained a few updates repeats words up to fairseq's default limit of 200
#: tokens (max_len_a 0, max_len_b 200): 155 tokens a hypothesis on average, three times the CPU
#: of generating 20, for nothing a comparison of the translations learns.
SHORT_GENERATION = ["--max-len-a", "0", "--max-len-b", "20"]
