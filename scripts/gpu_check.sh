#!/usr/bin/env bash
# The GPU check: run once on a machine with NVIDIA GPUs. It builds the environment there
# (.gpu-env/, on top of the machine's own CUDA torch), runs the `cuda` tests
# (tests/test_cuda.py) and writes gpu_report.md: GPU, driver, versions, each test's result,
# the estimator's prediction against the measured allocator peak.
#
#   scripts/gpu_check.sh              on the GPU machine (no network needed once prepared)
#   scripts/gpu_check.sh prepare [PY] here, with PyPI reachable, before a GPU session without
#                                     network: wheels and sdists for Python PY (default 3.12)
#                                     into .whl/ (git-ignored), which travels with the repo
#
# Environment: PYTHON (default python3; must hold a CUDA build of torch, or pip must reach an
# index to install the pinned one), GPU_CHECK_TIMEOUT (seconds for the tests, default 540),
# GPU_CHECK_ALLOW_CPU=1 (check the script itself on a machine without GPU: the tests skip).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
wheels="$root/.whl"
# What fairseq-fixed needs at import and the tests need, beyond torch and numpy: pip name,
# import name. Versions come from requirements*.txt (one pinned set).
needed=(hydra-core:hydra omegaconf:omegaconf antlr4-python3-runtime:antlr4 bitarray:bitarray
        regex:regex sacrebleu:sacrebleu tqdm:tqdm scikit-learn:sklearn sentencepiece:sentencepiece
        packaging:packaging pytest:pytest iniconfig:iniconfig pluggy:pluggy pygments:pygments)
pin() {  # the pinned version of a pip name
  local v
  v="$(grep -hiE "^$1==" "$root"/requirements*.txt | head -1 | sed -E 's/^[^=]+==([^ #]+).*/\1/')"
  case "$1" in  # requirements of hydra-core and pytest, not pinned in requirements*.txt
    antlr4-python3-runtime) v="${v:-4.9.3}" ;;  # hydra-core 1.3.2: antlr4-python3-runtime==4.9.*
    iniconfig) v="${v:-2.1.0}" ;;
    pluggy) v="${v:-1.6.0}" ;;
    pygments) v="${v:-2.21.0}" ;;
  esac
  echo "$v"
}

if [[ "${1:-}" == "prepare" ]]; then
  pyver="${2:-3.12}"
  rm -rf "$wheels" && mkdir -p "$wheels"  # one Python's set only (it travels: 64 MiB at most)
  binary=() source=()
  for entry in "${needed[@]}"; do
    name="${entry%%:*}"
    [[ "$name" == antlr4-python3-runtime ]] && source+=("$name==$(pin "$name")") \
      || binary+=("$name==$(pin "$name")")
  done
  plat=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    plat+=(--platform "$p")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp "${plat[@]}" -d "$wheels" "${binary[@]}"
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$wheels" "${source[@]}"
  # fairseq-fixed is an sdist whose metadata step imports torch: use the project's venv
  "$root/.venv/bin/python" -m pip download -q --no-deps --no-build-isolation -d "$wheels" \
    "$(grep -E '^fairseq-fixed==' "$root/requirements-fairseq.txt")"
  du -sh "$wheels"
  echo "[gpu_check] .whl/ ready for Python $pyver; on the GPU machine: bash scripts/gpu_check.sh"
  exit 0
fi

out="$root/.gpu-check"
rm -rf "$out" && mkdir -p "$out"
log="$out/build.log"
py="${PYTHON:-python3}"
command -v nvidia-smi >/dev/null && nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  if [[ -n "${GPU_CHECK_ALLOW_CPU:-}" ]] && "$py" -c "import torch" 2>/dev/null; then
    echo "[gpu_check] GPU_CHECK_ALLOW_CPU: checking the script itself; every cuda test skips" >&2
  elif "$py" -c "import torch" 2>/dev/null; then
    echo "gpu_check: error: $py has torch but sees no CUDA GPU (nvidia-smi: $(head -1 "$out/nvidia-smi.txt" 2>/dev/null || echo missing))" >&2
    exit 2
  else
    # no torch at all: the pinned one, from an index (on Linux PyPI serves the CUDA build)
    echo "[gpu_check] $py has no torch: installing torch==$(pin torch) from the index" >&2
    "$py" -m pip install -q "torch==$(pin torch)" >>"$log" 2>&1 || {
      echo "gpu_check: error: $py has no torch and pip could not install torch==$(pin torch) (see $log)" >&2; exit 2; }
  fi
fi

# .gpu-env: a venv that sees the machine's own packages (its CUDA torch, numpy, pytest...)
# through a .pth file and adds only what is missing; nothing of the machine is replaced.
start=$(date +%s)
env_dir="$root/.gpu-env"
if [[ ! -x "$env_dir/bin/python" ]]; then
  "$py" -m venv --without-pip "$env_dir"
  env_site="$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # addsitedir, not a plain path line: the machine's own .pth files must run too
  "$py" -c 'import site; print("".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))' \
    >"$env_site/_gpu_check_base.pth"
fi
epy="$env_dir/bin/python"
missing=()
for entry in "${needed[@]}"; do
  "$epy" -c "import ${entry##*:}" 2>/dev/null || missing+=("${entry%%:*}==$(pin "${entry%%:*}")")
done
"$epy" -c "import fairseq" 2>/dev/null || missing+=("$(grep -E '^fairseq-fixed==' requirements-fairseq.txt)")
if ((${#missing[@]})); then
  # --no-deps: nothing else (above all no other torch) is pulled in; --no-build-isolation:
  # fairseq-fixed's extensions build against this machine's torch; without CUDA_HOME its setup
  # skips its CUDA extensions (nvcc for minutes; translation uses none). Offline from .whl/
  # when it is there, else from the index.
  index=()
  [[ -d "$wheels" ]] && ls "$wheels"/* >/dev/null 2>&1 && index=(--no-index --find-links "$wheels")
  echo "[gpu_check] installing ${missing[*]} ${index:+(from .whl/)}" >&2
  env -u CUDA_HOME "$epy" -m pip install -q --no-deps --no-build-isolation "${index[@]}" "${missing[@]}" \
    >>"$log" 2>&1 || { echo "gpu_check: error: installing ${missing[*]} failed (see $log)" >&2; exit 2; }
fi
"$epy" -c "import torch, fairseq, fairseq_fsdp2" 2>>"$log" || {
  echo "gpu_check: error: the environment does not import (see $log)" >&2; exit 2; }
build_s=$(( $(date +%s) - start ))
echo "[gpu_check] environment ready in ${build_s} s" >&2

# The cuda tests (tests/test_cuda.py): one GPU tests always, two-GPU tests where there are two.
start=$(date +%s)
set +e
FAIRSEQ_FSDP2_GPU_TABLE="$out/estimates.jsonl" OMP_NUM_THREADS=4 MALLOC_MMAP_THRESHOLD_=65536 \
  PYTHONPATH="$root" timeout "${GPU_CHECK_TIMEOUT:-540}" "$epy" -m pytest -p no:cacheprovider \
  -m cuda tests/test_cuda.py -v -rA --junitxml "$out/junit.xml" >"$out/pytest.log" 2>&1
status=$?
set -e
tests_s=$(( $(date +%s) - start ))
"$epy" "$root/tests/gpu_report.py" --out "$root/gpu_report.md" --dir "$out" \
  --build-seconds "$build_s" --test-seconds "$tests_s" --pytest-status "$status"
tail -3 "$out/pytest.log"
echo "[gpu_check] wrote gpu_report.md (tests: exit $status, ${tests_s} s; environment: ${build_s} s)"
exit "$status"
