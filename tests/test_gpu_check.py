"""scripts/gpu_check.sh without a GPU: the requirement walk that replaces pip's resolver offline
(tests/gpu_env.py), the report written in every state (tests/gpu_report.py), and the script
itself with the project's .venv standing in for the GPU machine's image: a failed build replaces
an old report, and a test phase stopped at its time limit or by SIGTERM leaves a report that
lists what passed and what never ran.

The whole check against a fresh stand-in image, offline (``gpu_check.sh dryrun``, about 5
minutes on 2 cores: a new environment, a download from PyPI, fairseq-fixed's build) is the last
test; it runs where GPU_CHECK_DRYRUN=1 (.ci/run runs it as its own step).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename

import gpu_env
import gpu_report
from conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"
PY312 = gpu_env.target_env("3.12")


def reqs(*texts: str) -> list[Requirement]:
    return [Requirement(t) for t in texts]


def cand(name: str, version: str, *requires: str) -> gpu_env.Candidate:
    return gpu_env.Candidate(name, version, Path(f"{name}-{version}.whl"), reqs(*requires))


HYDRA = {"hydra-core": cand("hydra-core", "1.3.2", "omegaconf<2.4,>=2.2", "packaging",
                            "antlr4-python3-runtime==4.9.*",
                            'importlib-resources; python_version < "3.9"'),
         "omegaconf": cand("omegaconf", "2.3.0", "antlr4-python3-runtime==4.9.*",
                           "PyYAML>=5.1.0"),
         "antlr4-python3-runtime": cand("antlr4-python3-runtime", "4.9.3")}


def walk(have: dict, candidates: dict, *roots: str, env=PY312) -> gpu_env.Resolution:
    return gpu_env.resolve([(r, "requirements.txt") for r in reqs(*roots)], have, candidates,
                           env)


# -- the requirement walk ------------------------------------------------------------------------

def test_runtime_pins_come_from_requirements_txt_never_from_requirements_dev():
    """The old pin() took the first match over requirements*.txt: requirements-dev.txt's
    regex (a test fixture's) sorts first."""
    dev = gpu_report.pins(REPO)
    assert ("regex", "2025.9.18", "requirements.txt") in dev
    assert any(n == "regex" and f == "requirements-dev.txt" and v != "2025.9.18"
               for n, v, f in dev), "the fixture pin no longer differs: the test bites no more"
    pins = gpu_env.read_pins(REPO)
    assert pins["regex"] == ("2025.9.18", "requirements.txt")
    assert pins["fairseq-fixed"] == ("0.12.3.1", "requirements-fairseq.txt")


def test_walk_installs_what_the_image_lacks_and_what_that_needs():
    found = walk({"packaging": "25.0", "pyyaml": "6.0.2"}, HYDRA, "hydra-core")
    assert sorted(found.install) == ["antlr4-python3-runtime", "hydra-core", "omegaconf"]
    assert not found.problems and not found.shadows


def test_an_image_version_outside_a_requirement_is_replaced_from_wheels_or_refused():
    """antlr4 4.13 in the image breaks hydra-core 1.3.2 (==4.9.*): .whl/'s 4.9.3 goes first
    on the path; without it, the walk says so (the old script checked import names only)."""
    have = {"packaging": "25.0", "pyyaml": "6.0.2", "antlr4-python3-runtime": "4.13.2"}
    found = walk(have, HYDRA, "hydra-core")
    assert found.install["antlr4-python3-runtime"].version == "4.9.3" and not found.problems
    assert found.shadows == ["antlr4-python3-runtime 4.9.3 over the image's 4.13.2 (hydra-core "
                             "1.3.2 needs antlr4-python3-runtime==4.9.*)"]
    without = {k: v for k, v in HYDRA.items() if k != "antlr4-python3-runtime"}
    found = walk(have, without, "hydra-core")
    assert len(found.problems) == 1  # hydra-core and omegaconf need it: said once
    assert "the image has antlr4-python3-runtime 4.13.2; .whl/ has none" in found.problems[0]


def test_a_wheel_of_the_wrong_version_is_refused():
    wrong = {**HYDRA, "omegaconf": cand("omegaconf", "2.0.6")}
    found = walk({"packaging": "25.0"}, wrong, "hydra-core")
    assert found.problems == ["hydra-core 1.3.2 needs omegaconf<2.4,>=2.2; the image has no "
                              "omegaconf, and .whl/ has omegaconf 2.0.6"]


def test_markers_are_those_of_the_target_python():
    need = {"tomli": cand("tomli", "2.2.1")}
    for python, installs in (("3.12", []), ("3.10", ["tomli"])):
        found = walk({}, need, 'tomli; python_version < "3.11"', env=gpu_env.target_env(python))
        assert sorted(found.install) == installs


def test_torch_is_never_installed_and_torchaudio_may_stay_missing():
    fairseq = cand("fairseq-fixed", "0.12.3.1", "torch>=1.13", "torchaudio>=0.8.0")
    found = walk({}, {"fairseq-fixed": fairseq, "torch": cand("torch", "2.13.0")},
                 "fairseq-fixed")
    assert list(found.install) == ["fairseq-fixed"]
    assert found.problems == ["fairseq-fixed 0.12.3.1 needs torch>=1.13; the image has no torch, "
                              "and torch is never installed by the check"]
    assert found.exempt and "torchaudio" in found.exempt[0]
    found = walk({"torch": "2.11.0+cu130"}, {"fairseq-fixed": fairseq}, "fairseq-fixed")
    assert not found.problems and list(found.install) == ["fairseq-fixed"]


def test_candidates_come_from_each_files_own_metadata(tmp_path):
    with zipfile.ZipFile(tmp_path / "omegaconf-2.3.0-py3-none-any.whl", "w") as z:
        z.writestr("omegaconf-2.3.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: omegaconf"
                   "\nVersion: 2.3.0\nRequires-Dist: PyYAML>=5.1.0\n\nbody\n")
    src = tmp_path / "src" / "fairseq_fixed-0.12.3.1"
    src.mkdir(parents=True)
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: fairseq-fixed\nVersion: 0.12.3.1"
                                  "\nRequires-Dist: hydra-core==1.3.2\n")
    with tarfile.open(tmp_path / "fairseq_fixed-0.12.3.1.tar.gz", "w:gz") as t:
        t.add(src, arcname=src.name)
    found = gpu_env.read_candidates(tmp_path)
    assert {k: (c.version, [str(r) for r in c.requires], c.is_sdist) for k, c in found.items()} \
        == {"omegaconf": ("2.3.0", ["PyYAML>=5.1.0"], False),
            "fairseq-fixed": ("0.12.3.1", ["hydra-core==1.3.2"], True)}
    with zipfile.ZipFile(tmp_path / "omegaconf-2.2.3-py3-none-any.whl", "w") as z:
        z.writestr("omegaconf-2.2.3.dist-info/METADATA", "Name: omegaconf\nVersion: 2.2.3\n")
    with pytest.raises(gpu_env.EnvError, match="two versions of omegaconf"):
        gpu_env.read_candidates(tmp_path)


def test_wheels_prepared_for_another_python_are_refused(tmp_path):
    with pytest.raises(gpu_env.EnvError, match="no PREPARED.json"):
        gpu_env.check_python(tmp_path)
    (tmp_path / "PREPARED.json").write_text(json.dumps({"python": "3.12"}))
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here == "3.12":
        gpu_env.check_python(tmp_path)
        (tmp_path / "PREPARED.json").write_text(json.dumps({"python": "3.11"}))
    with pytest.raises(gpu_env.EnvError, match=f"is Python {here}: run `bash scripts/gpu_check.sh"
                                               f" prepare {here}`"):
        gpu_env.check_python(tmp_path)


# -- the report --------------------------------------------------------------------------------

def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))


def events(path: Path, *items: dict) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in items))


def test_report_of_a_run_stopped_at_its_limit_lists_what_never_ran(tmp_path):
    write_json(tmp_path / "build.json", {"state": "ok", "seconds": 80})
    write_json(tmp_path / "test.json", {"state": "timeout", "limit": 500, "seconds": 510,
                                        "exit": 124})
    write_json(tmp_path / "versions.json", {
        "torch": {"version": "2.11.0+cu130", "where": "image"},
        "numpy": {"version": "2.4.6", "where": "image"},
        "hydra-core": {"version": "1.3.2", "where": "added"}})
    a, b, c, d = (f"tests/test_cuda.py::test_{x}" for x in "abcd")
    events(tmp_path / "results.jsonl", {"event": "collected", "tests": [a, b, c, d]},
           {"event": "start", "test": a},
           {"event": "result", "test": a, "outcome": "passed", "note": "", "seconds": 3.0},
           {"event": "start", "test": b},
           {"event": "result", "test": b, "outcome": "failed", "note": "assert 1 == 2",
            "seconds": 2.0},
           {"event": "start", "test": c})
    text = gpu_report.render(tmp_path, REPO)
    assert "**Stopped at the time limit** (500 s for the tests)." in text
    assert "| `test_a` | passed | 3.0 |  |" in text
    assert "| `test_b` | failed | 2.0 | assert 1 == 2 |" in text
    assert "| `test_c` | stopped while running |  |  |" in text
    assert "| `test_d` | not run |  |  |" in text
    assert "1 failed, 1 not run, 1 passed, 1 stopped while running of 4" in text
    assert "### Skipped: not proven on this machine\n\nNone.\n" in text
    # torch 2.11 against the pinned 2.13 is flagged; numpy meets its pin; a local version
    # (+cu130, +cpu) does not count
    assert "| torch | 2.13.0 | requirements.txt | 2.11.0+cu130 (image) |" in text
    assert "| numpy |" not in text
    assert "| hydra-core |" not in text
    assert "| omegaconf | 2.3.0 | requirements.txt | absent |" in text
    write_json(tmp_path / "test.json", {"state": "running"})
    assert "| `test_c` | running when written |" in gpu_report.render(tmp_path, REPO)


def test_report_lists_every_skipped_test_with_its_reason(tmp_path):
    write_json(tmp_path / "build.json", {"state": "ok", "seconds": 80})
    write_json(tmp_path / "test.json", {"state": "done", "exit": 0, "seconds": 9})
    a, b, c = (f"tests/test_cuda.py::test_{x}" for x in "abc")
    events(tmp_path / "results.jsonl", {"event": "collected", "tests": [a, b, c]},
           {"event": "result", "test": a, "outcome": "skipped", "note": "needs 2 GPUs, found 1",
            "seconds": 0.0},
           {"event": "result", "test": b, "outcome": "passed", "note": "", "seconds": 1.0},
           {"event": "result", "test": c, "outcome": "skipped", "note": "", "seconds": 0.0})
    text = gpu_report.render(tmp_path, REPO)
    section = text.split("### Skipped: not proven on this machine\n\n", 1)[1].split("\n\n")[0]
    assert section.splitlines() == ["- `test_a`: needs 2 GPUs, found 1",
                                    "- `test_c`: (no reason given)"], section


def test_report_gives_the_8_bit_step_row_or_says_it_is_pending(tmp_path):
    """tests/test_cuda_step.py's row (record_row "step") in its own table, the ratio and the
    peak's error as measured; none: pending."""
    write_json(tmp_path / "build.json", {"state": "ok", "seconds": 80})
    write_json(tmp_path / "test.json", {"state": "done", "exit": 0, "seconds": 9})
    heading = "## The optimizer step with 8-bit Adam moments, NLLB-3.3B's dimensions, one GPU"
    text = gpu_report.render(tmp_path, REPO)
    assert heading in text and "Pending: not measured" in text.split(heading)[1].split("##")[0]
    events(tmp_path / "estimates.jsonl", {
        "table": "step", "name": "NLLB-3.3B, every parameter on one GPU",
        "elements": 3_344_863_232, "fp32_step_s": 0.0812, "eight_bit_step_s": 0.3501,
        "ratio": 4.312, "peak_gib": 5.102, "predicted_gib": 4.892, "error": -0.0412})
    text = gpu_report.render(tmp_path, REPO)
    assert ("| NLLB-3.3B, every parameter on one GPU (3.34B) | 0.081 | 0.350 | 4.31x | 5.10 | "
            "4.89 | -4.1% |") in text
    assert "Pending: not measured" not in text


def test_report_gives_the_one_gpu_3_3b_row_or_says_it_is_pending(tmp_path):
    """tests/test_cuda.py's one-GPU NLLB-3.3B row with the step in backward (record_row "one
    GPU") in its own table, its error as measured; none: pending."""
    write_json(tmp_path / "build.json", {"state": "ok", "seconds": 80})
    write_json(tmp_path / "test.json", {"state": "done", "exit": 0, "seconds": 9})
    heading = "## NLLB on one GPU (docs/memory.md), measured"
    section = lambda text: text.split(heading)[1].split("##")[0]  # noqa: E731
    assert "Pending: no row measured" in section(gpu_report.render(tmp_path, REPO))
    events(tmp_path / "estimates.jsonl", {
        "table": "one GPU", "name": "NLLB-3.3B, step in backward", "measured_gib": 16.012,
        "predicted_gib": 15.507, "error": -0.032, "peak_at": "backward: reduce-scatter shared"})
    text = section(gpu_report.render(tmp_path, REPO))
    assert ("| NLLB-3.3B, step in backward | 16.01 | 15.51 | -3.2% | backward: reduce-scatter "
            "shared |") in text and "Pending" not in text


def test_report_of_a_failed_build_says_so_and_lists_no_test(tmp_path):
    write_json(tmp_path / "build.json", {"state": "failed", "error": "no torch"})
    text = gpu_report.render(tmp_path, REPO)
    assert text.splitlines()[2] == "**Build failed**: no torch. No test ran."
    assert "Versions not recorded" in text


# -- the script, with .venv standing in for the image -------------------------------------------

def script_env(tmp: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.update(PYTHON=sys.executable, GPU_CHECK_ALLOW_CPU="1", GPU_CHECK_WORK=str(tmp / "work"),
               GPU_CHECK_REPORT=str(tmp / "gpu_report.md"), GPU_CHECK_WHEELS=str(tmp / "whl"))
    env.update(extra)
    return env


def test_a_failed_build_replaces_the_old_report_and_says_why_in_one_line(tmp_path):
    notorch = tmp_path / "notorch"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(notorch)], check=True)
    (tmp_path / "gpu_report.md").write_text("# an old report: every test passed\n")
    proc = subprocess.run(["bash", str(SCRIPT), "build"], capture_output=True, text=True,
                          env=script_env(tmp_path, PYTHON=str(notorch / "bin" / "python")))
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gpu_check: error:")]
    assert errors == [f"gpu_check: error: {notorch}/bin/python has no torch: the check runs on "
                      "the image's own CUDA build of torch"], proc.stderr
    report = (tmp_path / "gpu_report.md").read_text()
    assert "**Build failed**" in report and "old report" not in report


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The environment built once: .venv has every package, so nothing is installed."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    (tmp / "whl").mkdir()
    proc = subprocess.run(["bash", str(SCRIPT), "build"], capture_output=True, text=True,
                          env=script_env(tmp))
    assert proc.returncode == 0, proc.stderr
    (tmp / "slow").mkdir()
    (tmp / "slow" / "test_slow.py").write_text(
        "import os, time, pytest\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_sleeps(i):\n"
        f"    open({str(tmp / 'slow' / 'pids')!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "    slow = float(os.environ.get('SLOW_TEST_S', '2'))\n"
        "    time.sleep(float(os.environ.get('FIRST_TEST_S', slow)) if i == 0 else slow)\n")
    (tmp / "quick").mkdir()
    (tmp / "quick" / "test_quick.py").write_text("def test_nothing():\n    pass\n")
    return tmp


def slow_tests(tmp: Path, **extra: str) -> dict:
    return script_env(tmp, GPU_CHECK_TESTS=str(tmp / "slow" / "test_slow.py"), **extra)


def outcomes(report: str) -> list[str]:
    return [line.split(" | ")[1] for line in report.splitlines()
            if line.startswith("| `test_sleeps[")]


def test_tests_stopped_at_the_time_limit_leave_a_report_of_what_never_ran(built):
    """Six tests, each as long as the whole limit: the limit stops the run (whatever pytest's
    start-up took, at most one test runs); the report says so and lists every test, those that
    never ran as 'not run'. The limit must leave pytest time to start and collect: it is
    derived from this machine, twice the whole check's test step on one empty test measured
    just before (start-up, collection, the report), plus 4 s."""
    started = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), "test"], capture_output=True, text=True,
                          env=script_env(built, GPU_CHECK_TESTS=str(built / "quick")))
    assert proc.returncode == 0, proc.stderr
    limit = str(math.ceil(2 * (time.monotonic() - started)) + 4)
    proc = subprocess.run(["bash", str(SCRIPT), "test"], capture_output=True, text=True,
                          env=slow_tests(built, GPU_CHECK_TEST_TIMEOUT=limit, SLOW_TEST_S=limit))
    assert proc.returncode == 124, proc.stderr
    report = (built / "gpu_report.md").read_text()
    assert f"**Stopped at the time limit** ({limit} s for the tests)." in report
    assert outcomes(report) == ["stopped while running"] + ["not run"] * 5, report


def test_sigterm_during_the_tests_leaves_a_report_and_no_test_process(built):
    results = built / "work" / "results.jsonl"
    results.unlink(missing_ok=True)  # an earlier test's
    # The first test passes at once; each later one sleeps 60 s, longer than a SIGTERM takes
    # to arrive on a loaded machine (the script's SIGTERM ends it: no wait for it)
    proc = subprocess.Popen(["bash", str(SCRIPT), "test"], stderr=subprocess.PIPE, text=True,
                            env=slow_tests(built, FIRST_TEST_S="0", SLOW_TEST_S="60"))
    # SIGTERM once the first test has finished (the second then runs, 4 more never do).
    # The wait ends at that event; its limit only bounds a hung run (the suite's 600 s, as
    # tests/test_faults.py's HANG_S; a run with no result by then fails the checks below):
    # start-up time depends on the CPU and its load
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and '"event": "result"' not in (
            results.read_text() if results.exists() else ""):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    report = (built / "gpu_report.md").read_text()
    assert "**Interrupted** (SIGTERM or SIGINT) before the tests ended." in report
    found = outcomes(report)
    assert found.count("passed") >= 1 and "not run" in found and len(found) == 6, found
    for pid in map(int, (built / "slow" / "pids").read_text().split()):
        with pytest.raises(ProcessLookupError):  # pytest went with the script
            os.kill(pid, 0)


# -- the whole check against a fresh stand-in image (opt-in) ------------------------------------

@pytest.mark.skipif(os.environ.get("GPU_CHECK_DRYRUN") != "1",
                    reason="the GPU check's dry run (about 5 minutes on 2 cores): set "
                           "GPU_CHECK_DRYRUN=1; .ci/run runs it as its own step")
def test_dry_run_installs_offline_from_wheels_alone_and_writes_the_report(tmp_path):
    """Python 3.11 with the project's pins (torch 2.13 CPU) as the image: see
    tests/gpu_dryrun.py for what that proves and what it does not. Also the 3.12 .whl/ that
    the GPU machine gets: complete against the script's image list."""
    proc = subprocess.run(["bash", str(SCRIPT), "prepare", "3.12"], capture_output=True,
                          text=True, env={**os.environ, "GPU_CHECK_WHEELS": str(tmp_path / "w")})
    assert proc.returncode == 0, proc.stderr
    prepared = json.loads((tmp_path / "w" / "PREPARED.json").read_text())
    names = sorted(n.split("-")[0] for n in prepared["files"])
    # protobuf: pinned in requirements.txt for editing SentencePiece models (data/spm_model.py);
    # ninja: pinned there to build the 8-bit kernel (optimizer/moments/kernels.py); the image's list
    # (gpu_check.sh) names neither, so .whl/ carries them
    assert names == ["antlr4_python3_runtime", "bitarray", "cffi", "fairseq_fixed", "hydra_core",
                     "ninja", "omegaconf", "protobuf", "pycparser"], prepared
    wheels = [f for f in prepared["files"] if f.endswith(".whl")]
    # for Python 3.12: its own cp312 wheels, pure-Python ones, or the stable ABI from an earlier
    # CPython on (protobuf's cp310-abi3)
    tags = {t for f in wheels for t in parse_wheel_filename(f)[3]}
    assert all(t.interpreter in ("cp312", "py3") or t.abi == "abi3" and
               t.interpreter.startswith("cp3") and int(t.interpreter[3:]) <= 12 for t in tags), tags
    assert {t.interpreter for t in tags} >= {"cp312", "py3"}
    proc = subprocess.run(["bash", str(SCRIPT), "dryrun", "3.11", "--dir", str(tmp_path / "d")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    run = json.loads((tmp_path / "d" / "dryrun.json").read_text())
    assert run["offline"], "unshare -n did not work: the build was offline by pip's settings only"
    report = (tmp_path / "d" / "gpu_report.md").read_text()
    assert "**Complete**: every test that ran passed." in report
    assert "State: ok" in report and "(built in this call)" in report
    rows = [line for line in report.splitlines() if line.startswith("| `test_")]
    assert len(rows) >= 20 and all(" | skipped | " in row for row in rows), rows
    skipped = report.split("### Skipped: not proven on this machine\n\n", 1)[1].split("\n\n")[0]
    assert len(skipped.splitlines()) == len(rows), skipped  # each with the reason pytest gave
    assert "(no reason given)" not in skipped, skipped
    versions = json.loads((tmp_path / "d" / "work" / "versions.json").read_text())
    added = sorted(k for k, v in versions.items() if v["where"] == "added")
    assert added == ["antlr4-python3-runtime", "bitarray", "cffi", "fairseq-fixed", "hydra-core",
                     "ninja", "omegaconf", "protobuf", "pycparser"], added
    assert versions["torch"]["where"] == "image"
    env = tmp_path / "d" / "work" / "env"
    assert not list(env.glob("fairseq/libnat_cuda*")), "a CUDA extension was built"
    assert list(env.glob("fairseq/libnat.*.so")) and list(env.glob("fairseq/libbleu.*.so"))
