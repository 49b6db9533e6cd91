#!/usr/bin/env bash
# Set up .venv (idempotent) and run the test suite (CPU only, no network).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m slow` or `scripts/test.sh -k algos`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
