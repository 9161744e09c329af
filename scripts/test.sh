#!/usr/bin/env bash
# The test command of README.md: set up .venv (scripts/bootstrap.sh), then run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow" -x`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
venv="${VENV:-$root/.venv}"
exec "$venv/bin/python" -m pytest "$@"
