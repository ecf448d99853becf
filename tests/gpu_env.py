"""The GPU check's environment (scripts/gpu_check.sh): what the GPU machine's image lacks, taken
from pinned files in .whl/ only, and a check that everything installed fits together.

The GPU machine has no network: whatever its image lacks travels in .whl/. pip's own resolver
cannot be used there (with an index turned off it would still try to replace image packages,
and fairseq-fixed asks for torchaudio, which the project leaves out), so the resolution is
made here, from each file's own metadata, the same way in both places:

- ``prepare`` (here, with PyPI): starting from the runtime pins, every requirement the image
  list does not satisfy is downloaded at its pinned version for the target Python, and its own
  requirements followed, until nothing is missing; .whl/PREPARED.json records the Python.
- ``plan`` (there, offline): the same walk against the image's real installed versions and the
  files in .whl/; prints what to install, or one line per unmet requirement.
- ``verify`` (there, after the install): every requirement of every package the check relies on
  is met by what Python now imports, and fairseq's compiled extensions load.

Needs ``packaging`` (the image has it; so does .venv).
"""
from __future__ import annotations

import argparse
import email.parser
import importlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from gpu_report import NOT_NEEDED  # pins the check leaves out (charts, the suite's workers)

REPO = Path(__file__).resolve().parent.parent
#: The pinned set the check installs from. requirements-dev.txt is left out on purpose: its
#: pins (a newer regex, transformers...) are test fixtures that live in a folder of their own
#: (scripts/setup.sh), and the cuda tests use none of them.
RUNTIME_PINS = ("requirements.txt", "requirements-fairseq.txt")
#: Never installed: the image's CUDA build of torch is what the check is about.
IMAGE_ONLY = {"torch"}
#: Built on the GPU machine against its torch (C++ and Cython extensions): travels as an sdist.
FROM_SOURCE = {"fairseq-fixed"}
#: Requirements that may stay unmet, with the reason (the report lists them).
EXEMPT = {"torchaudio": "fairseq-fixed's requirement for its speech tasks; translation never "
                        "imports it, and no release matches the pinned torch 2.13"}
#: fairseq-fixed's compiled extensions that the plugin and the tests reach.
EXTENSIONS = ("fairseq.libbleu", "fairseq.data.data_utils_fast",
              "fairseq.data.token_block_utils_fast", "fairseq.libbase", "fairseq.libnat")
PREPARED = "PREPARED.json"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


class EnvError(Exception):
    """Bad input or an unmet requirement: one line for the user."""


@dataclass
class Candidate:
    """One file of .whl/: a wheel or an sdist, with the requirements its metadata declares."""
    name: str
    version: str
    path: Optional[Path]
    requires: list[Requirement] = field(default_factory=list)

    @property
    def is_sdist(self) -> bool:
        return self.path is not None and not self.path.name.endswith(".whl")


@dataclass
class Resolution:
    """What a walk over the requirements found."""
    install: dict[str, Candidate] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # name: who needs it, and how
    problems: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)  # image versions taken on trust
    exempt: list[str] = field(default_factory=list)
    shadows: list[str] = field(default_factory=list)  # installed over an image version


def read_pins(repo: Path = REPO, files=RUNTIME_PINS) -> dict[str, tuple[str, str]]:
    """name: (version, file) of every ``name==version`` line of the runtime requirement files."""
    pins: dict[str, tuple[str, str]] = {}
    for name in files:
        for line in (repo / name).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z0-9._-]+)\s*==\s*([^\s;]+)", line)
            if not m:
                raise EnvError(f"{name}: not a plain pin: {line!r}")
            key = canonicalize_name(m.group(1))
            if key in pins and pins[key][0] != m.group(2):
                raise EnvError(f"{key} is pinned twice: {pins[key][0]} ({pins[key][1]}) and "
                               f"{m.group(2)} ({name})")
            pins[key] = (m.group(2), name)
    return pins


def roots(pins: dict[str, tuple[str, str]]) -> list[tuple[Requirement, str]]:
    """What the check relies on: every runtime pin but those it does not need, at any version
    (an image version that differs from the pin is used, and reported as a deviation)."""
    return [(Requirement(name), pins[name][1]) for name in pins if name not in NOT_NEEDED]


def parse_image(entries: list[str]) -> dict[str, Optional[str]]:
    """The script's image list: ``name`` or ``name==version`` (as read on the machine)."""
    image = {}
    for entry in entries:
        name, _, version = entry.partition("==")
        image[canonicalize_name(name)] = version or None
    return image


def requirements_of(text: str) -> list[Requirement]:
    message = email.parser.Parser().parsestr(text, headersonly=True)
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def candidate(path: Path) -> Candidate:
    """A .whl/ file's name, version and declared requirements (from the file itself)."""
    if path.name.endswith(".whl"):
        name, version, _, _ = parse_wheel_filename(path.name)
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist()
                        if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode()
    elif path.name.endswith(".tar.gz"):
        name, version = parse_sdist_filename(path.name)
        with tarfile.open(path) as t:
            member = next(m for m in t.getmembers() if m.name.count("/") == 1
                          and m.name.endswith("/PKG-INFO"))
            text = t.extractfile(member).read().decode()
    else:
        raise EnvError(f"{path}: neither a wheel nor an sdist")
    return Candidate(str(name), str(version), path, requirements_of(text))


def read_candidates(folder: Path) -> dict[str, Candidate]:
    found: dict[str, Candidate] = {}
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not path.name.endswith((".whl", ".tar.gz")):
            continue
        c = candidate(path)
        if c.name in found:  # pip would stop at the install; say it here
            raise EnvError(f"{folder} holds two versions of {c.name}: {found[c.name].path.name} "
                           f"and {path.name}; run prepare again")
        found[c.name] = c
    return found


def fits(version: Optional[str], req: Requirement) -> bool:
    if version is None:
        return True
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def resolve(wanted: list[tuple[Requirement, str]], have: dict[str, Optional[str]],
            candidates: dict[str, Candidate], env: dict[str, str]) -> Resolution:
    """Walk the requirements from ``wanted`` (requirement, who wants it): each is met by the
    image (``have``; a version of None is unknown and taken on trust) or by a file of
    ``candidates``, whose own requirements are then walked. Where both fail, the requirement is
    ``missing`` (no file of that name) or a ``problem`` (a file, of the wrong version)."""
    out = Resolution()
    queue = list(wanted)
    while queue:
        req, by = queue.pop(0)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in out.install:
            if not fits(out.install[name].version, req):
                out.problems.append(f"{by} needs {req}, but {name} {out.install[name].version} "
                                    "is the one in .whl/")
            continue
        if name in have and fits(have[name], req):
            if have[name] is None and str(req.specifier):
                out.assumed.append(f"{name} for {by}'s {req} (image version not known)")
            continue
        if name in EXEMPT:
            out.exempt.append(f"{by} needs {req}: left out ({EXEMPT[name]})")
            continue
        image = f"the image has {name} {have[name]}" if name in have else \
            f"the image has no {name}"
        if name in IMAGE_ONLY:
            out.problems.append(f"{by} needs {req}; {image}, and {name} is never installed "
                                "by the check")
            continue
        c = candidates.get(name)
        if c is None:
            out.missing.setdefault(name, f"{by} needs {req}; {image}")
            continue
        if not fits(c.version, req):
            out.problems.append(f"{by} needs {req}; {image}, and .whl/ has {name} {c.version}")
            continue
        out.install[name] = c
        if name in have:  # first on the path, the installed one wins over the image's
            out.shadows.append(f"{name} {c.version} over the image's {have[name]} ({by} "
                               f"needs {req})")
        queue += [(r, f"{name} {c.version}") for r in c.requires]
    for name, why in out.missing.items():
        out.problems.append(f"{why}; .whl/ has none")
    return out


def target_env(python: str) -> dict[str, str]:
    """The marker environment of CPython ``python`` (major.minor) on x86-64 Linux."""
    env = dict(default_environment())
    env.update(python_version=python, python_full_version=f"{python}.0",
               implementation_name="cpython", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
               os_name="posix")
    return env


def installed() -> dict[str, str]:
    """name: version of what this Python imports (the first of a name on sys.path wins)."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist.version)
    return found


# -- prepare (here, with PyPI) -----------------------------------------------------------------

def pip(python: str, *args: str) -> None:
    proc = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True)
    if proc.returncode:
        lines = [l for l in proc.stderr.splitlines() if l.startswith("ERROR")] or \
            proc.stderr.strip().splitlines()[-1:]
        raise EnvError(f"pip {args[0]} {args[-1]}: {lines[0] if lines else 'failed'}")


def fetch(name: str, version: str, python: str, dest: Path, builder: str) -> None:
    """One file for ``name==version`` into dest, for CPython ``python`` on x86-64 Linux: a
    binary wheel; fairseq-fixed as its sdist; a package with no wheel as a wheel built here,
    kept only if pure Python (antlr4-python3-runtime 4.9.3 is an sdist only)."""
    spec = f"{name}=={version}"
    if name in FROM_SOURCE:
        # its metadata step imports torch: run by a Python that has one (.venv)
        pip(builder, "download", "--no-deps", "--no-build-isolation", "--no-binary", ":all:",
            "-d", str(dest), spec)
        return
    target = ["--python-version", python, "--implementation", "cp"]
    for p in PLATFORMS:
        target += ["--platform", p]
    try:
        pip(sys.executable, "download", "--no-deps", "--only-binary", ":all:", *target,
            "-d", str(dest), spec)
        return
    except EnvError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        pip(builder, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp, spec)
        (built,) = Path(tmp).glob("*.whl")
        if not built.name.endswith("-py3-none-any.whl"):
            raise EnvError(f"{spec} has no wheel for Python {python} and is not pure Python "
                           f"({built.name})")
        built.rename(dest / built.name)


def pinned_version(name: str, pins: dict[str, tuple[str, str]]) -> str:
    """The runtime pin, else the version the project's own environment (.venv, the verified
    one) has; never a fresh pick from the index."""
    if name in pins:
        return pins[name][0]
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        raise EnvError(f"no pinned version of {name}: pin it in requirements.txt") from None


def prepare(dest: Path, python: str, image: dict[str, Optional[str]], builder: str,
            repo: Path = REPO) -> Resolution:
    """Fill ``dest`` (empty) with the closure of what the image lacks, for Python ``python``."""
    if not re.fullmatch(r"3\.\d+", python):
        raise EnvError(f"prepare: Python version {python!r}: give major.minor, e.g. 3.12")
    pins = read_pins(repo)
    env = target_env(python)
    wanted = roots(pins)
    while True:
        found = resolve(wanted, image, read_candidates(dest), env)
        if not found.missing:
            break
        for name in found.missing:
            fetch(name, pinned_version(name, pins), python, dest, builder)
    if found.problems:
        raise EnvError("; ".join(found.problems))
    (dest / PREPARED).write_text(json.dumps({
        "python": python, "files": sorted(c.path.name for c in found.install.values()),
        "assumed": found.assumed, "exempt": found.exempt}, indent=1) + "\n")
    return found


# -- plan and verify (there, offline) ------------------------------------------------------------

def check_python(wheels: Path) -> None:
    info = wheels / PREPARED
    if not info.exists():
        raise EnvError(f"{wheels} has no {PREPARED}: fill it with `bash scripts/gpu_check.sh "
                       "prepare X.Y` where PyPI is reachable")
    want = json.loads(info.read_text())["python"]
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if want != here:
        raise EnvError(f"{wheels} was prepared for Python {want} but {sys.executable} is "
                       f"Python {here}: run `bash scripts/gpu_check.sh prepare {here}` where "
                       "PyPI is reachable")


def plan(wheels: Path, repo: Path = REPO) -> Resolution:
    """What to install from ``wheels`` on this Python (the image's), or EnvError."""
    found = resolve(roots(read_pins(repo)), installed(), read_candidates(wheels),
                    default_environment())
    if found.install:
        check_python(wheels)
    if found.problems:
        raise EnvError("; ".join(found.problems))
    return found


def verify(repo: Path = REPO) -> Resolution:
    """After the install, in the environment the tests get: nothing unmet, extensions load."""
    found = resolve(roots(read_pins(repo)), installed(), {}, default_environment())
    if found.problems:
        raise EnvError("after the install: " + "; ".join(found.problems))
    for module in ("torch", "fairseq", "fairseq_fsdp2", *EXTENSIONS):
        try:
            importlib.import_module(module)
        except Exception as e:  # one line whatever the import raised
            raise EnvError(f"after the install, import {module} fails: "
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="fill an empty folder for a Python (here, with PyPI)")
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--python", required=True, help="major.minor of the GPU machine's Python")
    p.add_argument("--builder", required=True, help="a Python with torch (.venv's)")
    p.add_argument("--image", nargs="*", default=[], help="name or name==version, the image's")
    p = sub.add_parser("plan", help="what to install from .whl/ (there); prints file paths")
    p.add_argument("--wheels", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="JSON: files, notes")
    sub.add_parser("verify", help="after the install: requirements met, extensions load")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            found = prepare(args.dest, args.python, parse_image(args.image), args.builder)
            for line in found.assumed + found.exempt:
                print(f"[gpu_check] note: {line}", file=sys.stderr)
        elif args.command == "plan":
            found = plan(args.wheels)
            args.out.write_text(json.dumps({
                "files": [str(c.path) for c in found.install.values()],
                "notes": found.shadows + found.exempt}, indent=1) + "\n")
        else:
            found = verify()
            for line in found.exempt:
                print(f"[gpu_check] note: {line}", file=sys.stderr)
    except EnvError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
