"""Writes gpu_report.md for scripts/gpu_check.sh from the files of its work folder, whatever
state the check is in: building, built, tests running (rewritten after each test by
gpu_check_plugin.py), finished, stopped at the time limit, interrupted, or a failed build.

Standard library only (``machine`` imports torch, inside that command): the report must be
written even when the build failed for want of a package.

Work-folder files: source.json (commit, source digest), machine.json, build.json (state,
seconds, error, notes), versions.json (every distribution Python sees, image or added),
test.json (state, limit, seconds, exit), results.jsonl (collected tests, each start and
result, appended as they happen), estimates.jsonl (rows the memory tests measured).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIN_FILES = ("requirements.txt", "requirements-fairseq.txt", "requirements-dev.txt")
#: Pinned in requirements.txt but not needed by the GPU check: charts and the suite's workers.
NOT_NEEDED = {"matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pillow",
              "ctranslate2",  # the CTranslate2 export (evaluation/), not the GPU check
              "pyparsing", "python-dateutil", "pytest-xdist", "execnet"}
#: What the source digest covers: what decides the tests' behaviour.
DIGEST_GLOBS = ("fairseq_fsdp2/**/*.py", "tests/**/*.py", "scripts/*", "configs/**/*",
                "requirements*.txt", "pyproject.toml")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a kill
            pass
    return out


# -- what the script records -----------------------------------------------------------------

def source_digest(repo: Path = REPO) -> str:
    """sha256 over the files that decide the tests' behaviour (path and content), so that a
    report from a machine without .git can be matched to a checkout: compare with
    ``python tests/gpu_report.py digest`` there."""
    h = hashlib.sha256()
    files = sorted({p for g in DIGEST_GLOBS for p in repo.glob(g)
                    if p.is_file() and "__pycache__" not in p.parts})
    for p in files:
        h.update(str(p.relative_to(repo)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def source(repo: Path = REPO) -> dict:
    def git(*args) -> str:
        try:
            proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return ""
        return proc.stdout.strip() if proc.returncode == 0 else ""
    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None
    commit = commit or os.environ.get("GPU_CHECK_COMMIT", "")
    return {"commit": commit or "unknown (no .git here; set GPU_CHECK_COMMIT)",
            "dirty": dirty, "digest": source_digest(repo)}


def machine() -> dict:
    """The GPU(s), driver, CPU, memory, Python and torch (imports torch)."""
    info = {"python": platform.python_version(), "executable": sys.executable,
            "kernel": platform.release(), "cores": os.cpu_count()}
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        info["cpu"] = re.search(r"model name\s*:\s*(.*)", cpu).group(1)
        mem = Path("/proc/meminfo").read_text()
        info["memory_gib"] = round(int(re.search(r"MemTotal:\s*(\d+)", mem).group(1)) / 2**20, 1)
    except (OSError, AttributeError):
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,"
                              "compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
        info["gpus"] = smi.stdout.strip().splitlines() if smi.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    try:
        import torch
        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["cudnn"] = torch.backends.cudnn.version()
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            info["devices"] = [f"{torch.cuda.get_device_name(i)} (capability "
                               f"{'.'.join(map(str, torch.cuda.get_device_capability(i)))}, "
                               f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.1f}"
                               " GiB)" for i in range(torch.cuda.device_count())]
    except Exception as e:  # recorded, not raised: the report says what went wrong
        info["torch_error"] = f"{type(e).__name__}: {e}"
    return info


def versions(site: str) -> dict:
    """Every distribution this Python sees, first on the path wins; ``where``: added (under
    ``site``, what the check installed) or image."""
    out = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        key = re.sub(r"[-_.]+", "-", name).lower()
        where = "added" if site and str(dist.locate_file("")).startswith(site) else "image"
        out.setdefault(key, {"version": dist.version, "where": where})
    return dict(sorted(out.items()))


# -- the report ------------------------------------------------------------------------------

def pins(repo: Path) -> list[tuple[str, str, str]]:
    """(name, version, file) of every pin of the requirement files."""
    out = []
    for file in PIN_FILES:
        for line in (repo / file).read_text().splitlines() if (repo / file).exists() else []:
            m = re.fullmatch(r"([A-Za-z0-9._-]+)\s*==\s*([^\s;#]+)", line.split("#")[0].strip())
            if m:
                out.append((re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(2), file))
    return out


def deviations(repo: Path, installed: dict) -> list[str]:
    """Each pin not met. A test-fixture pin (requirements-dev.txt, which scripts/setup.sh puts
    in a folder of its own, and the cuda tests do not use) counts only for a package installed
    here with no runtime pin."""
    rows = []
    every = pins(repo)
    runtime = {name for name, _, file in every if file != "requirements-dev.txt"}
    for name, version, file in every:
        have = installed.get(name)
        if file == "requirements-dev.txt" and (have is None or name in runtime):
            continue
        public = have["version"].split("+")[0] if have else None  # 2.13.0+cpu meets ==2.13.0
        if public != version:
            here = f"{have['version']} ({have['where']})" if have else \
                "absent" + (" (not needed by the check)" if name in NOT_NEEDED else "")
            rows.append(f"| {name} | {version} | {file} | {here} |")
    return rows


def status(build: dict, test: dict, current: str) -> str:
    if build.get("state") == "failed":
        return f"**Build failed**: {build.get('error', '(see build.log)')}. No test ran."
    if build.get("state") == "running":
        return ("**Build in progress** (started " + build.get("started", "?") + "). If this "
                "line is still here, the build was stopped from outside before it ended.")
    state = test.get("state")
    if not state:
        return ("**Environment built; the tests have not run yet** "
                "(`bash scripts/gpu_check.sh test`).")
    if state == "running":
        return ("**Tests in progress** (this file is rewritten after each test; if this line is "
                "still here, the run was stopped from outside" +
                (f", during `{current}`" if current else "") + ").")
    if state == "timeout":
        return f"**Stopped at the time limit** ({test.get('limit')} s for the tests)."
    if state == "interrupted":
        return "**Interrupted** (SIGTERM or SIGINT) before the tests ended."
    if state == "no-time":
        return (f"**Tests not started**: {test.get('limit')} s were left of the call's budget "
                "(GPU_CHECK_BUDGET); run `bash scripts/gpu_check.sh test` in a call of its own.")
    code = test.get("exit")
    return {0: "**Complete**: every test that ran passed.",
            1: "**Complete, with failures** (see Tests)."}.get(
        code, f"**Tests ended with pytest exit status {code}** (see pytest.log).")


def test_rows(work: Path, running: bool) -> tuple[list[str], dict, str, bool]:
    """Table rows, counts, the test started and not ended, whether collection finished."""
    collected: list[str] = []
    results: dict[str, dict] = {}
    started = ""
    for e in events(work / "results.jsonl"):
        if e.get("event") == "collected":
            collected = e["tests"]
        elif e.get("event") == "start":
            started = e["test"]
        elif e.get("event") == "result":
            results[e["test"]] = e
    current = started if started and started not in results else ""
    cut = "running when written" if running else "stopped while running"
    counts: dict[str, int] = {}
    rows = []
    for name in collected + [t for t in results if t not in collected]:
        r = results.get(name)
        outcome = r["outcome"] if r else (cut if name == current else "not run")
        counts[outcome] = counts.get(outcome, 0) + 1
        note = (r or {}).get("note", "").replace("|", "/").replace("\n", " ")
        seconds = f"{r['seconds']:.1f}" if r else ""
        rows.append(f"| `{name.split('::', 1)[-1]}` | {outcome} | {seconds} | {note} |")
    return rows, counts, current, bool(collected)


def skipped_lines(work: Path) -> list[str]:
    """One line per test that skipped, with its reason: the claims this run did not prove
    (the table holds them too, among the passes)."""
    results = {e["test"]: e for e in events(work / "results.jsonl") if e.get("event") == "result"}
    return [f"- `{name.split('::', 1)[-1]}`: {r.get('note') or '(no reason given)'}"
            for name, r in results.items() if r.get("outcome") == "skipped"]


def render(work: Path, repo: Path = REPO) -> str:
    src, mach = load(work / "source.json"), load(work / "machine.json")
    build, test = load(work / "build.json"), load(work / "test.json")
    installed = load(work / "versions.json")
    rows, counts, current, collected = test_rows(work, test.get("state") == "running")
    lines = ["# GPU check report (scripts/gpu_check.sh)", "",
             status(build, test, current), "",
             f"Written {now()}. Commit {src.get('commit', '?')}"
             + (" with uncommitted changes" if src.get("dirty") else "")
             + f"; source digest {src.get('digest', '?')} (`python tests/gpu_report.py digest`)."]
    lines += ["", "## Machine", ""]
    gpus = mach.get("devices") or mach.get("gpus") or ["none seen"]
    lines += [f"- GPU: {g}" for g in gpus]
    if mach.get("gpus") and mach.get("devices"):
        lines += [f"- nvidia-smi: {g}" for g in mach["gpus"]]
    lines += [f"- CPU: {mach.get('cpu', '?')}, {mach.get('cores', '?')} cores, "
              f"{mach.get('memory_gib', '?')} GiB; kernel {mach.get('kernel', '?')}",
              f"- Python {mach.get('python', '?')} ({mach.get('executable', '?')}); torch "
              f"{mach.get('torch', mach.get('torch_error', '?'))}, CUDA {mach.get('cuda')}, "
              f"cuDNN {mach.get('cudnn')}, NCCL {mach.get('nccl')}"]
    lines += ["", "## Build", "",
              f"State: {build.get('state', 'not started')}"
              + (f", {build['seconds']} s" if "seconds" in build else "")
              + (f" ({build['when']})" if build.get("when") else "") + "."]
    lines += [f"- {n}" for n in build.get("notes", [])]
    ran = sum(v for k, v in counts.items())
    lines += ["", "## Tests", "",
              (f"{', '.join(f'{v} {k}' for k, v in sorted(counts.items()))} of {ran}"
               + (f"; {test['seconds']} s" if "seconds" in test else "")
               + (f" (limit {test['limit']} s)" if "limit" in test else "") + ".")
              if rows else ("pytest did not finish collecting." if test.get("state")
                            else "Not started.")]
    if rows:
        lines += ["", "| test | result | s | note |", "|---|---|---:|---|", *rows]
        lines += ["", "### Skipped: not proven on this machine", ""]
        lines += skipped_lines(work) or ["None."]
    measured = events(work / "estimates.jsonl")
    fitting = [r for r in measured if r.get("table") == "fitting"]
    lines += ["", "## Fitting NLLB-600M (README table), one GPU, measured", "",
              "`transformer_nllb_600m`, `--memory-efficient-fp16 --max-tokens 4096`, 128-token "
              "sentences, Adam; measured: the largest per-interval `mem_peak_gb_max` of updates "
              "2-3 (CUDA allocator).", ""]
    if fitting:
        lines += ["| settings | measured GiB | predicted GiB | error | predicted GiB, 2 GPUs |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['name']} | {r['measured_gib']:.2f} | {r['predicted_gib']:.2f} | "
                  f"{r['error'] * 100:+.1f}% | {r['predicted_2gpu_gib']:.2f} |" for r in fitting]
    else:
        lines.append("Pending: no row measured (the tests that measure it did not run).")
    one_gpu = [r for r in measured if r.get("table") == "one GPU"]
    lines += ["", "## NLLB on one GPU (docs/memory.md), measured", "",
              "`transformer_nllb_3_3b`, `--memory-efficient-bf16 --eight-bit-adam-stats "
              "--fsdp2-reduce-dtype bf16 --checkpoint-activations --fsdp2-step-in-backward "
              "--max-tokens 2048`; measured: the largest per-interval `mem_peak_gb_max` of "
              "updates 2-3 (CUDA allocator).", ""]
    if one_gpu:
        lines += ["| settings | measured GiB | predicted GiB | error | predicted peak at |",
                  "|---|---:|---:|---:|---|"]
        lines += [f"| {r['name']} | {r['measured_gib']:.2f} | {r['predicted_gib']:.2f} | "
                  f"{r['error'] * 100:+.1f}% | {r['peak_at']} |" for r in one_gpu]
    else:
        lines.append("Pending: no row measured (the test did not run, or the GPU has less "
                     "memory than the prediction needs: its skip says how much).")
    step = [r for r in measured if r.get("table") == "step"]
    lines += ["", "## The optimizer step with 8-bit Adam moments, NLLB-3.3B's dimensions, one GPU",
              "", "Every parameter of `transformer_nllb_3_3b` (float32, float32 gradients) on one "
              "GPU; the plugin's Adam with float32 and with 8-bit moments "
              "(`--eight-bit-adam-stats`) over the same parameters, stepped in turn: the median "
              "of the timed steps after the first (`tests/test_cuda_step.py`; issue 47's goal: "
              "at most 1.5x); the 8-bit step's allocator peak above its start against the "
              "estimator's step temporaries.", ""]
    if step:
        lines += ["| parameters | fp32 moments s | 8-bit s | ratio | 8-bit step peak GiB | "
                  "predicted GiB | error |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['name']} ({r['elements'] / 1e9:.2f}B) | {r['fp32_step_s']:.3f} | "
                  f"{r['eight_bit_step_s']:.3f} | {r['ratio']:.2f}x | {r['peak_gib']:.2f} | "
                  f"{r['predicted_gib']:.2f} | {r['error'] * 100:+.1f}% |" for r in step]
    else:
        lines.append("Pending: not measured (the test did not run).")
    estimator = [r for r in measured if r.get("table", "estimator") == "estimator"]
    lines += ["", "## Estimator (`--device cuda`) against the measured allocator peak", "",
              "One GPU, FSDP2 per-layer plan, root reshard always, fp32 Adam; measured: the "
              "largest per-interval `mem_peak_gb_max` of updates 2-3.", ""]
    if estimator:
        lines += ["| config | measured GiB | predicted GiB | error | predicted peak at |",
                  "|---|---:|---:|---:|---|"]
        lines += [f"| {r['name']} | {r['measured_gib']:.3f} | {r['predicted_gib']:.3f} | "
                  f"{r['error'] * 100:+.1f}% | {r['peak_at']} |" for r in estimator]
    else:
        lines.append("Pending: no row measured.")
    dev = deviations(repo, installed)
    lines += ["", "## Deviations from the pins", ""]
    if not installed:
        lines.append("Versions not recorded (the build stopped before).")
    elif dev:
        lines += ["| package | pinned | in | here |", "|---|---|---|---|", *dev]
    else:
        lines.append("None.")
    lines += ["", "## Installed packages", ""]
    if installed:
        lines += ["<details><summary>" + f"{len(installed)} distributions ("
                  + str(sum(v['where'] == 'added' for v in installed.values()))
                  + " added by the check)</summary>", "",
                  ", ".join(f"{k} {v['version']}" + (" (added)" if v["where"] == "added" else "")
                            for k, v in installed.items()), "", "</details>"]
    else:
        lines.append("Not recorded.")
    lines += ["", "Logs: build.log, pytest.log, results.jsonl in the work folder "
              f"({work.name}/)."]
    return "\n".join(lines) + "\n"


def write(work: Path, out: Path, repo: Path = REPO) -> None:
    """Atomically: a reader never sees half a report."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(work, repo))
    tmp.replace(out)


def update(path: Path, pairs: list[str]) -> None:
    """Merge key=value pairs into a JSON file (integers kept as numbers; note=... appends)."""
    data = load(path)
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key == "note":
            data.setdefault("notes", []).append(value)
        else:
            data[key] = int(value) if re.fullmatch(r"-?\d+", value) else value
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("write", help="render the report from the work folder")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("set", help="merge key=value into a JSON file of the work folder")
    p.add_argument("file", type=Path)
    p.add_argument("pairs", nargs="*")
    p.add_argument("--now", metavar="KEY", help="also KEY=<the time now>")
    p = sub.add_parser("record", help="write source.json, machine.json or versions.json")
    p.add_argument("what", choices=("source", "machine", "versions"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--site", default="", help="versions: the folder the check installs into")
    sub.add_parser("digest", help="print the source digest of this checkout")
    args = parser.parse_args(argv)
    if args.command == "write":
        write(args.work, args.out)
    elif args.command == "set":
        update(args.file, args.pairs + ([f"{args.now}={now()}"] if args.now else []))
    elif args.command == "record":
        data = {"source": source, "machine": machine,
                "versions": lambda: versions(args.site)}[args.what]()
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    else:
        print(source_digest())


if __name__ == "__main__":
    main()
