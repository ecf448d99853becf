"""The GPU check's dry run on CPU (``bash scripts/gpu_check.sh dryrun [X.Y]``): the whole
check, as on the GPU machine, against a fresh stand-in for its image.

1. image/: a new virtual environment of Python X.Y holding the image's packages only (the list
   IMAGE in scripts/gpu_check.sh, with their own requirements), installed from PyPI;
2. whl/: ``gpu_check.sh prepare X.Y`` (PyPI);
3. ``gpu_check.sh build`` then ``gpu_check.sh test``, offline: pip's configuration and index
   off (the script's own doing) and, where ``unshare -n`` works (root), in a network namespace
   with no network at all; python3 is the stand-in image's, as on the GPU machine. Every cuda
   test skips (GPU_CHECK_ALLOW_CPU=1); the report is written.

Which torch: on Python 3.12 (the image's) the image's own torch 2.11.0, which on PyPI is the
CUDA build (about 3 GB with its CUDA libraries; it imports and builds extensions on CPU): the
closest stand-in. On another Python (3.11: the development machines' and CI's, whose pinned
torch 2.13.0 is a local CPU wheel there) the project's pins stand in for the image's versions,
torch included, and the report shows that version: what it proves is the mechanism (offline
install from .whl/ alone, the requirement walk, fairseq-fixed's parallel build, the test phase
and the report), not the cp312 wheels nor the build against torch 2.11.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
PIN_FILES = ("requirements.txt", "requirements-fairseq.txt")


def image_list() -> tuple[str, list[str]]:
    """IMAGE_PYTHON and IMAGE, read from the script (the one place they are written)."""
    text = SCRIPT.read_text()
    python = re.search(r"^IMAGE_PYTHON=(\S+)", text, re.M).group(1)
    body = re.search(r"^IMAGE=\(([^)]*)\)", text, re.M).group(1)
    return python, body.split()


def pins() -> dict[str, str]:
    out = {}
    for file in PIN_FILES:
        for line in (REPO / file).read_text().splitlines():
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.split("#")[0].strip())
            if m:
                out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def image_specs(python: str) -> list[str]:
    """What the stand-in image installs: on the image's Python the image's versions where read,
    else the runtime pins where pinned, else the newest; on another Python the pins."""
    image_python, entries = image_list()
    pinned = pins()
    specs = []
    for entry in entries:
        name, _, version = entry.partition("==")
        key = re.sub(r"[-_.]+", "-", name).lower()
        if python != image_python or not version:
            version = pinned.get(key, "")
        specs.append(f"{name}=={version}" if version else name)
    return specs


def find_python(version: str) -> str:
    found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    path = found[-1] if found else shutil.which(f"python{version}")
    if not path:
        raise SystemExit(f"gpu_dryrun: error: no Python {version} here (pyenv or PATH)")
    return path


def offline_prefix() -> list[str]:
    """``unshare -n`` where it can make a network namespace (root), else nothing."""
    try:
        ok = subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    except OSError:
        ok = False
    return ["unshare", "-n"] if ok else []


def step(name: str, cmd: list[str], timings: dict, **kw) -> int:
    print(f"[gpu_dryrun] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(cmd, **kw).returncode
    timings[name] = round(time.monotonic() - t0, 1)
    print(f"[gpu_dryrun] {name}: exit {rc}, {timings[name]} s", file=sys.stderr, flush=True)
    return rc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("python", nargs="?", default=image_list()[0], help="major.minor")
    parser.add_argument("--dir", type=Path, help="work folder (default /tmp/gpu-dryrun-X.Y)")
    parser.add_argument("--budget", type=int, default=570, help="GPU_CHECK_BUDGET per call")
    args = parser.parse_args(argv)
    base = (args.dir or Path(f"/tmp/gpu-dryrun-{args.python}")).resolve()
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    timings: dict = {}
    image = base / "image"
    if step("image venv", [find_python(args.python), "-m", "venv", str(image)], timings) or \
            step("image packages", [str(image / "bin" / "python"), "-m", "pip", "install", "-q",
                                    "--disable-pip-version-check", *image_specs(args.python)],
                 timings):
        return 2
    paths = {"GPU_CHECK_WHEELS": str(base / "whl"), "GPU_CHECK_WORK": str(base / "work"),
             "GPU_CHECK_REPORT": str(base / "gpu_report.md")}
    if step("prepare", ["bash", str(SCRIPT), "prepare", args.python], timings,
            env={**os.environ, **paths}):
        return 2
    # as on the GPU machine: python3 is the image's, no CUDA_HOME, no pip settings of ours
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "GPU_CHECK_", "CUDA_")) and k not in ("PYTHON",
                                                                            "PYTHONPATH")}
    env.update(paths, PATH=f"{image / 'bin'}:{env['PATH']}", GPU_CHECK_ALLOW_CPU="1",
               GPU_CHECK_BUDGET=str(args.budget))
    offline = offline_prefix()
    if not offline:
        print("[gpu_dryrun] note: unshare -n is not available: offline by pip's settings only",
              file=sys.stderr)
    rc_build = step("build", [*offline, "bash", str(SCRIPT), "build"], timings, env=env)
    rc_test = step("test", [*offline, "bash", str(SCRIPT), "test"], timings, env=env)
    (base / "dryrun.json").write_text(json.dumps({
        "python": args.python, "image": image_specs(args.python), "offline": bool(offline),
        "build_exit": rc_build, "test_exit": rc_test, "seconds": timings}, indent=1) + "\n")
    print(f"[gpu_dryrun] report: {paths['GPU_CHECK_REPORT']}; seconds: {timings}",
          file=sys.stderr)
    return rc_build or rc_test


if __name__ == "__main__":
    sys.exit(main())
