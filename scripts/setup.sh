#!/usr/bin/env bash
# Create or update .venv with the pinned set. Idempotent: when the pinned files have not changed
# since the last successful run, it only checks the stamp (a second run takes seconds).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp="$venv/.fairseq_fsdp2-setup"
want="$(cat "$root/requirements.txt" "$root/requirements-fairseq.txt" "$root/requirements-dev.txt" "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"

# both packages still found (not imported: importing fairseq and torch takes 8 CPU-s on some
# of our CPUs, on every launch of the scripts that call this)
found='import importlib.util as u, sys; sys.exit(not (u.find_spec("fairseq") and u.find_spec("fairseq_fsdp2")))'
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c "$found" 2>/dev/null; then
  exit 0
fi

echo "[setup] installing the pinned environment into $venv (first time: about 4 minutes)" >&2
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -r "$root/requirements.txt"
# fairseq-fixed is an sdist with C/Cython extensions. --no-build-isolation builds it against the
# torch installed above (an isolated build would download a multi-GB CUDA torch), --no-deps keeps
# pip from pulling torchaudio, which would replace torch.
"${pip[@]}" install --no-deps --no-build-isolation -r "$root/requirements-fairseq.txt"
# Test-only fairscale and transformers (see requirements-dev.txt): in their own folder, on no
# default path.
"${pip[@]}" install --no-deps --no-build-isolation --upgrade --target "$venv/fixture-deps" \
  -r "$root/requirements-dev.txt"
# The plugin itself, editable, so that `--user-dir fairseq_fsdp2` and `import fairseq_fsdp2` agree.
"${pip[@]}" install --no-deps --no-build-isolation -e "$root"
"$venv/bin/python" -c "import torch, fairseq, fairseq_fsdp2; print('[setup] torch', torch.__version__, 'fairseq', fairseq.__version__)" >&2
# The 8-bit moments' C++ CPU kernel (fairseq_fsdp2/optimizer/moments/kernels.py), built now (about 30
# CPU-s, then cached by PyTorch) rather than by the first run that needs it; where it cannot be
# built, a warning says so and runs compute the same values without it.
"$venv/bin/python" "$root/scripts/build_kernels.py" >&2
echo "$want" > "$stamp"
