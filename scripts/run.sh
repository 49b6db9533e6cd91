#!/usr/bin/env bash
# Set up .venv (idempotent) and run the main job: `launch.py` with the given arguments
# (none = the embedded default: local Ray, the bundled tiny model and task).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python launch.py "$@"
