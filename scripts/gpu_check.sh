#!/usr/bin/env bash
# The GPU check: the `cuda` tests (tests/test_cuda_step.py, tests/test_cuda.py) on a machine
# with an NVIDIA GPU, and gpu_report.md, written whatever happens (docs/gpu_check.md).
#
#   bash scripts/gpu_check.sh prepare [X.Y]  here, with PyPI: .whl/ holds what the GPU
#                                            machine's image lacks, for its Python (3.12)
#   bash scripts/gpu_check.sh build          there, offline: installs from .whl/ on top of
#                                            the image (.gpu-check/env), records versions
#   bash scripts/gpu_check.sh test           there: the cuda tests in the time left (builds
#                                            first if the environment is not there)
#   bash scripts/gpu_check.sh [all]          build, then test, in one call
#   bash scripts/gpu_check.sh dryrun [X.Y]   here, on CPU: prepare, build and test against a
#                                            fresh stand-in image (tests/gpu_dryrun.py)
#
# Environment: PYTHON (the image's Python, with its CUDA torch; default python3),
# GPU_CHECK_BUDGET (seconds this command may take; default 570, a 600 s call less a margin),
# GPU_CHECK_OUT (a folder that also gets the report and logs), GPU_CHECK_COMMIT (the commit,
# where the copy has no .git), GPU_CHECK_ALLOW_CPU=1 (no GPU: every cuda test skips; the dry
# run), GPU_CHECK_WHEELS, GPU_CHECK_WORK, GPU_CHECK_REPORT (default .whl/, .gpu-check/,
# gpu_report.md), GPU_CHECK_TESTS (pytest arguments instead of `-m cuda
# tests/test_cuda_step.py tests/test_cuda.py`, for this script's own tests),
# GPU_CHECK_TEST_TIMEOUT (a lower cap on the tests' seconds).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$SECONDS

# The GPU machine's image, as read there (2026-11: python3 is Python 3.12.3 with torch
# 2.11.0+cu130): the packages the check relies on it for, version where read. It holds many
# more; what it lacks or this list does not name (hydra-core, omegaconf, antlr4, bitarray, cffi,
# fairseq-fixed; protobuf) travels in .whl/. `prepare` takes this list for what the image has;
# the dry run's stand-in image holds exactly these (with their own requirements).
IMAGE_PYTHON=3.12
IMAGE=(torch==2.11.0 numpy==2.5.2 sentencepiece==0.2.2 setuptools wheel cython packaging pyyaml
       regex sacrebleu tqdm scikit-learn scipy pytest pip)

cmd="${1:-all}"
py="${PYTHON:-python3}"
budget="${GPU_CHECK_BUDGET:-570}"
wheels="${GPU_CHECK_WHEELS:-$root/.whl}"
work="${GPU_CHECK_WORK:-$root/.gpu-check}"
report="${GPU_CHECK_REPORT:-$root/gpu_report.md}"
env_dir="$work/env"  # what the check installs (pip --target), first on PYTHONPATH
margin=25            # seconds kept for the report after the tests are stopped
child="" phase=""

die() { echo "gpu_check: error: $*" >&2; exit 2; }

case "$cmd" in
  prepare)
    pyver="${2:-$IMAGE_PYTHON}"
    venv_py="$root/.venv/bin/python"
    [[ -x "$venv_py" ]] || die "prepare needs .venv (bash scripts/setup.sh): fairseq-fixed's sdist imports torch to describe itself"
    tmp="$wheels.tmp"
    rm -rf "$tmp" && mkdir -p "$tmp"
    "$venv_py" "$root/tests/gpu_env.py" prepare --dest "$tmp" --python "$pyver" \
      --builder "$venv_py" --image "${IMAGE[@]}" || { rm -rf "$tmp"; exit 2; }
    # Python's headers, in case the image's Python has none (fairseq-fixed's extensions need
    # Python.h); the build uses them only then, and says so.
    for inc in "$HOME"/.pyenv/versions/"$pyver".*/include/python"$pyver" /usr/include/python"$pyver"; do
      if [[ -f "$inc/Python.h" ]]; then
        tar czf "$tmp/python-headers.tgz" -C "$(dirname "$inc")" "$(basename "$inc")"
        break
      fi
    done
    rm -rf "$wheels" && mv "$tmp" "$wheels"  # replaced only once complete
    ls "$wheels"
    echo "[gpu_check] $(du -sh "$wheels" | cut -f1) in $wheels for Python $pyver; there: bash scripts/gpu_check.sh build" >&2
    exit 0 ;;
  dryrun)
    shift
    exec "$root/.venv/bin/python" "$root/tests/gpu_dryrun.py" "$@" ;;
  build|test|all) ;;
  *) die "unknown command '$cmd' (prepare, build, test, all, dryrun)" ;;
esac

mkdir -p "$work"
# the report writer is standard-library Python: the image's, or any python3 if that one fails
rpy="$py"; "$rpy" -c "" 2>/dev/null || rpy=python3
rep() { "$rpy" "$root/tests/gpu_report.py" "$@"; }
copy_out() {
  [[ -n "${GPU_CHECK_OUT:-}" ]] || return 0
  mkdir -p "$GPU_CHECK_OUT"
  for f in "$report" "$work"/{build.log,pytest.log,results.jsonl,machine.json}; do
    [[ -f "$f" ]] && tail -c 15000000 "$f" >"$GPU_CHECK_OUT/$(basename "$f")"
  done
  return 0
}
write_report() {
  rep write --work "$work" --out "$report" 2>>"$work/report.log" ||
    echo "gpu_check: the report could not be written (see $work/report.log)" >&2
  copy_out
}
# Long steps run in the background so that a signal is handled at once, not after them.
bg() { "$@" & child=$!; wait "$child"; local rc=$?; child=""; return $rc; }
on_signal() {
  trap - TERM INT HUP
  if [[ -n "$child" ]]; then
    kill -TERM "$child" 2>/dev/null  # timeout(1) passes it on to the tests' process group
    (sleep 10; kill -KILL "$child") >/dev/null 2>&1 &
    local killer=$!
    wait "$child" 2>/dev/null
    kill "$killer" 2>/dev/null
  fi
  if [[ "$phase" == test ]]; then
    rep set "$work/test.json" state=interrupted seconds=$((SECONDS - test_t0))
  elif [[ "$phase" == build ]]; then
    rep set "$work/build.json" state=failed "error=interrupted (SIGTERM or SIGINT) during the build"
  fi
  echo "gpu_check: interrupted" >&2
  exit 143
}
trap on_signal TERM INT HUP
trap write_report EXIT

last_error() {  # the helper's one-line error, or where to look
  local line
  line="$(grep '^gpu_check: error: ' "$work/build.log" | tail -1 | sed 's/^gpu_check: error: //')"
  echo "${line:-$1 failed (see $work/build.log)}"
}
build_failed() {
  rep set "$work/build.json" state=failed "error=$1" seconds=$((SECONDS - build_t0))
  echo "gpu_check: error: $1" >&2
  return 2
}

stamp() {  # what the environment was built from: .whl/'s contents (a fresh copy has new
           # dates), the image's Python and torch, the pins
  { (cd "$wheels" 2>/dev/null && sha256sum -- * 2>/dev/null); grep -E '"(python|executable|torch)"' "$work/machine.json"
    cat "$root"/requirements.txt "$root"/requirements-fairseq.txt "$root/tests/gpu_env.py"; } |
    sha256sum | cut -d' ' -f1
}

build() {
  phase=build build_t0=$SECONDS
  rm -f "$work"/{build.json,test.json,results.jsonl,estimates.jsonl,versions.json,plan.json}
  rep set "$work/build.json" state=running --now started
  rep record source --out "$work/source.json"
  write_report  # replaces an earlier report at once: nothing old looks current
  local log="$work/build.log"
  : >"$log"
  "$py" -c "" 2>>"$log" || { build_failed "$py does not run (PYTHON: the image's Python)"; return; }
  bg "$py" "$root/tests/gpu_report.py" record machine --out "$work/machine.json" 2>>"$log" ||
    { build_failed "$(last_error "recording the machine")"; return; }
  "$py" - "$work/machine.json" <<'EOF' 2>>"$log"
import json, sys
m = json.load(open(sys.argv[1]))
sys.exit(0 if m.get("cuda_available") else 1 if "torch" in m else 3)
EOF
  case $? in
    0) ;;
    1) if [[ -n "${GPU_CHECK_ALLOW_CPU:-}" ]]; then
         rep set "$work/build.json" "note=GPU_CHECK_ALLOW_CPU: no CUDA GPU here; every cuda test skips"
       else
         build_failed "$py's torch sees no CUDA GPU (set GPU_CHECK_ALLOW_CPU=1 to check the script itself)"; return
       fi ;;
    *) build_failed "$py has no torch: the check runs on the image's own CUDA build of torch"; return ;;
  esac
  if [[ -f "$env_dir/.stamp" && "$(cat "$env_dir/.stamp")" == "$(stamp)" ]]; then
    rep set "$work/build.json" state=ok "when=built by an earlier call, reused" seconds=$((SECONDS - build_t0))
    PYTHONPATH="$env_dir:$root" rep record versions --site "$env_dir" --out "$work/versions.json"
    phase=""
    write_report
    return 0
  fi
  rm -rf "$env_dir" "$env_dir.tmp" && mkdir -p "$env_dir.tmp"
  "$py" "$root/tests/gpu_env.py" plan --wheels "$wheels" --out "$work/plan.json" 2>>"$log" ||
    { build_failed "$(last_error "planning the install from .whl/")"; return; }
  local files=()
  mapfile -t files < <("$py" -c 'import json, sys; print(*json.load(open(sys.argv[1]))["files"], sep="\n")' "$work/plan.json" | grep .)
  "$py" -c 'import json, sys; print(*json.load(open(sys.argv[1]))["notes"], sep="\n")' "$work/plan.json" |
    while read -r note; do [[ -n "$note" ]] && rep set "$work/build.json" "note=$note"; done
  if ((${#files[@]})); then
    if [[ ! -f "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]]; then
      [[ -f "$wheels/python-headers.tgz" ]] ||
        { build_failed "$py has no Python.h to build fairseq-fixed's extensions, and .whl/ has no python-headers.tgz"; return; }
      mkdir -p "$work/include" && tar xzf "$wheels/python-headers.tgz" -C "$work/include"
      export CPATH="$(echo "$work"/include/python*)${CPATH:+:$CPATH}"
      rep set "$work/build.json" "note=the image's Python has no headers: built with those carried in .whl/python-headers.tgz"
    fi
    command -v "${CXX:-c++}" >/dev/null ||
      { build_failed "no C++ compiler (${CXX:-c++}) for fairseq-fixed's extensions"; return; }
    # fairseq-fixed's six extensions build side by side (setuptools' build_ext --parallel,
    # through DIST_EXTRA_CONFIG); without ninja, since torch's ninja path writes one
    # build.ninja per build folder, which parallel extensions would share. Without CUDA_HOME
    # its setup.py leaves out its CUDA extensions (nvcc for minutes; translation uses none).
    # Offline from .whl/ alone: pip's configuration and index are off.
    printf '[build_ext]\nparallel = %s\n' "$(nproc)" >"$work/build_ext.cfg"
    mkdir -p "$work/no-ninja" && printf '#!/bin/sh\nexit 1\n' >"$work/no-ninja/ninja" && chmod +x "$work/no-ninja/ninja"
    local unset_pip=()
    for v in $(compgen -e | grep '^PIP_'); do unset_pip+=(-u "$v"); done
    echo "[gpu_check] installing ${files[*]##*/}" >&2
    bg env "${unset_pip[@]}" -u CUDA_HOME PIP_CONFIG_FILE=/dev/null DIST_EXTRA_CONFIG="$work/build_ext.cfg" \
      PATH="$work/no-ninja:$PATH" "$py" -m pip install -v --no-index --no-deps --no-build-isolation \
      --no-cache-dir --disable-pip-version-check --target "$env_dir.tmp" "${files[@]}" >>"$log" 2>&1 ||
      { build_failed "pip install from .whl/ failed: $(grep -E '^(ERROR|error):' "$log" | tail -1)"; return; }
  fi
  PYTHONPATH="$env_dir.tmp:$root" "$py" "$root/tests/gpu_env.py" verify 2>>"$log" ||
    { build_failed "$(last_error "checking the environment")"; return; }
  mv "$env_dir.tmp" "$env_dir" && stamp >"$env_dir/.stamp"
  PYTHONPATH="$env_dir:$root" rep record versions --site "$env_dir" --out "$work/versions.json"
  rep set "$work/build.json" state=ok "when=built in this call" seconds=$((SECONDS - build_t0))
  echo "[gpu_check] environment built in $((SECONDS - build_t0)) s" >&2
  phase=""
  write_report
}

built() {  # an environment built here from this .whl/, for this image
  [[ -f "$env_dir/.stamp" && "$(cat "$env_dir/.stamp")" == "$(stamp)" ]] &&
    "$rpy" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])).get("state") != "ok")' \
      "$work/build.json" 2>/dev/null
}

run_tests() {
  if ! built; then
    echo "[gpu_check] no environment built here yet: building it first, in this call" >&2
    build || return
  fi
  rep record source --out "$work/source.json"
  phase=test test_t0=$SECONDS
  local left=$((budget - (SECONDS - started) - margin))
  rm -f "$work"/{results.jsonl,estimates.jsonl,test.json}
  if ((left < 30)); then
    rep set "$work/test.json" state=no-time limit=$left
    echo "gpu_check: error: only $left s left for the tests: run 'bash scripts/gpu_check.sh test' in a call of its own" >&2
    return 3
  fi
  if [[ -n "${GPU_CHECK_TEST_TIMEOUT:-}" ]] && ((GPU_CHECK_TEST_TIMEOUT < left)); then
    left=$GPU_CHECK_TEST_TIMEOUT
  fi
  rep set "$work/test.json" state=running limit=$left --now started
  write_report
  local args=(-m cuda tests/test_cuda_step.py tests/test_cuda.py)
  [[ -n "${GPU_CHECK_TESTS:-}" ]] && read -r -a args <<<"$GPU_CHECK_TESTS"
  echo "[gpu_check] tests: at most $left s" >&2
  # in timeout's own process group: at the limit the tests' fairseq processes go too
  bg env PYTHONPATH="$env_dir:$root:$root/tests" GPU_CHECK_WORK="$work" GPU_CHECK_REPORT="$report" \
    FAIRSEQ_FSDP2_GPU_TABLE="$work/estimates.jsonl" OMP_NUM_THREADS=4 MALLOC_MMAP_THRESHOLD_=65536 PYTHONUNBUFFERED=1 \
    timeout -k 10 "$left" "$py" -m pytest -p no:cacheprovider -p gpu_check_plugin -v -rA "${args[@]}" \
    >"$work/pytest.log" 2>&1
  local rc=$?
  if ((rc == 124 || rc == 137)); then
    rep set "$work/test.json" state=timeout exit=$rc seconds=$((SECONDS - test_t0))
  else
    rep set "$work/test.json" state=finished exit=$rc seconds=$((SECONDS - test_t0))
  fi
  tail -3 "$work/pytest.log" >&2
  return $rc
}

case "$cmd" in
  build) build ;;
  test) run_tests ;;
  all) build && run_tests ;;
esac
rc=$?
echo "[gpu_check] wrote $report (exit $rc, $((SECONDS - started)) s)" >&2
exit $rc
