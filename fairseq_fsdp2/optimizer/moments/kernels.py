"""The plugin's C++ CPU kernels (``csrc/``): built from source with PyTorch's own extension
builder (``torch.utils.cpp_extension.load``: the C++ compiler fairseq's own build already
needs, and ninja, pinned in requirements.txt; the build is cached in PyTorch's extension
directory, ``TORCH_EXTENSIONS_DIR``, and rebuilt when the source or torch changes; concurrent
processes wait for one build). ``scripts/setup.sh`` builds them when it installs; a run that
needs them and finds no build builds it in its setup (launch/setup.py), before any collective
timeout applies, and the tests' ``scripts/test.sh`` through setup.sh.

A build killed midway (Ctrl-C, an OOM kill) leaves torch's lock file in the build directory,
and torch would wait for it forever; the build here holds a lock of its own as well, which the
operating system drops with a killed process, so a torch lock found while holding it is a dead
build's: it is removed, with one warning line, and the build starts again.

Why C++: the 8-bit moments' quantization (blockwise_8bit.py) is about 20 eager tensor
operations per element, four of them table gathers; one loop per block does the same float32
operations with one pass over memory (scripts/benchmark_moment_storage.py measures both). No
library fits: bitsandbytes' CPU quantization rounds to nearest and cuts blocks from the
flattened tensor, and ``torch.compile`` of the eager code was no faster on CPU (it keeps the
gathers scalar). The eager code stays as the reference and the fallback: where no compiler is
found, or with ``FAIRSEQ_FSDP2_NO_KERNELS=1``, it runs instead (a warning says so once), with
the same results bit for bit (tests/test_quantize_kernel.py).

    .venv/bin/python scripts/build_kernels.py     # build now (prints where, or why not)
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "blockwise_8bit.cpp"
NAME = "fairseq_fsdp2_blockwise_8bit"
#: no fused multiply-add: the kernel's float32 operations are the eager code's, rounding alike
CFLAGS = ["-O3", "-ffp-contract=off"]
DISABLE = "FAIRSEQ_FSDP2_NO_KERNELS"
#: the versions of the 8-bit kernel's loops (``isa``; the module's ``best_isa()`` says which
#: this CPU runs): plain C++, and AVX-512 where the CPU has it (gathers of 16 lanes)
PLAIN, AVX512 = 0, 1
#: how reports name them
LOOP_NAMES = {PLAIN: "plain C++", AVX512: "AVX-512"}

_lock = threading.Lock()
#: the loaded module (or None: unavailable), once per process: loading is a one-time cost of
#: the process, like importing a module
_loaded: dict[str, Optional[ModuleType]] = {}


def blockwise_8bit() -> Optional[ModuleType]:
    """The compiled module (``quantize_rows``, ``dequantize_rows``, ``best_isa``), or None
    where it cannot be built or is disabled."""
    with _lock:
        if NAME not in _loaded:
            _loaded[NAME] = _build()
        return _loaded[NAME]


def best_loops() -> int:
    """The 8-bit kernel's most capable loops this CPU runs (PLAIN where it is not built)."""
    module = blockwise_8bit()
    return PLAIN if module is None else module.best_isa()


#: torch's lock file in the build directory (torch.utils.cpp_extension._jit_compile's
#: FileBaton), and the one this module holds around the build (an flock: gone with its process)
TORCH_LOCK, OWN_LOCK = "lock", "fairseq_fsdp2.lock"


def _build() -> Optional[ModuleType]:
    if os.environ.get(DISABLE, "") not in ("", "0"):
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load
        directory = _get_build_directory(NAME, False)  # private: tests/test_private_torch.py
        with _build_lock(directory), _ninja_on_path():
            return load(NAME, [str(SOURCE)], extra_cflags=CFLAGS, build_directory=directory,
                        verbose=False)
    except Exception as error:  # no compiler, no ninja, no headers: the eager code runs
        lines = str(error).strip().splitlines()
        logger.warning("the 8-bit moments' C++ kernel could not be built (%s%s); the slower "
                       "eager tensor operations compute the same values instead",
                       type(error).__name__, f": {lines[-1]}" if lines else "")
        return None


@contextlib.contextmanager
def _build_lock(directory: str):
    """This process alone builds in ``directory`` (other processes wait here); a torch lock
    file found then was left by a killed build: removed, with one warning line."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, OWN_LOCK), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = os.path.join(directory, TORCH_LOCK)
            if os.path.exists(stale):
                logger.warning("removing %s, left by a build of the 8-bit kernel that was "
                               "stopped midway; building again", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path():
    """torch runs ``ninja`` from PATH; the pinned one (requirements.txt) is in the virtual
    environment's bin folder, on PATH only where the environment is activated. Put there for
    the build where PATH has none."""
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") or not shutil.which("ninja", path=bin_dir):
        yield
        return
    os.environ["PATH"] = bin_dir + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def main() -> int:
    module = blockwise_8bit()
    if module is None:
        print("fairseq_fsdp2 kernels: not built (the eager code runs): see the warning above")
        return 0
    print(f"fairseq_fsdp2 kernels: {module.__file__} ({LOOP_NAMES[best_loops()]} loops)")
    return 0
