#!/usr/bin/env bash
# Ray Serve on a local Ray instance: creates (or reuses) the virtual environment .venv-ray with
# the pinned Ray Serve and the torch-free deployment dependencies (requirements/ray-test.txt: Ray
# needs a newer protobuf than requirements/dev.txt pins, so it cannot share .venv), exports the
# demo model with the development environment, and runs tests/test_serve_ray.py in .venv-ray on
# this checkout (two replicas behind Ray Serve's proxy), checking that torch is not installed there.
#
#     bash scripts/test_ray.sh              # CI runs this (.ci/run)
#     bash scripts/test_ray.sh -v -x        # extra arguments go to pytest
#
# Idempotent: a second run reinstalls only when the requirement files changed. Environment knobs:
#   PYTHON=path     the development environment that exports the demo model (default .venv/bin/python);
#                   its base interpreter creates .venv-ray
#   VENV_RAY=path   where the Ray environment lives (default .venv-ray)
# The export goes into a temporary folder, removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
python=${PYTHON:-$repo/.venv/bin/python}
venv=${VENV_RAY:-$repo/.venv-ray}
[ -x "$python" ] || { echo "test_ray.sh: error: PYTHON=$python is not an executable Python" >&2; exit 2; }
start=$(date +%s)
say() { echo "[test_ray] $* ($(( $(date +%s) - start )) s)"; }

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    say "created $venv"
fi
stamp="$venv/.requirements.sha"
want=$(sha256sum requirements/ray-test.txt requirements/ray.txt requirements/serve.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    env -u PYTHONPATH "$venv/bin/python" -m pip install --quiet -r requirements/ray-test.txt
    echo "$want" > "$stamp"
    say "installed requirements/ray-test.txt into $venv"
fi
env -u PYTHONPATH "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
    || { echo "test_ray.sh: error: torch is installed in $venv; the Ray test runs the torch-free install" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/test_ray.XXXXXX")
trap 'rm -rf "$work"' EXIT
env -u PYTHONPATH "$python" -m export.onnx --output-dir "$work/demo-onnx" --no-validate > "$work/export.log" 2>&1 \
    || { tail -n 40 "$work/export.log"; exit 1; }
say "exported the demo model"

# tests/conftest.py imports torch (the development suite's fixtures): this module needs none of it.
# The Ray workers inherit PYTHONPATH, so every replica imports this checkout's transformer_ext.
RAY_USAGE_STATS_ENABLED=0 TRANSFORMER_EXT_RAY_EXPORT="$work/demo-onnx" PYTHONPATH="$repo" \
    "$venv/bin/python" -m pytest -p no:cacheprovider --noconftest -q -W ignore::DeprecationWarning tests/test_serve_ray.py "$@"
say "done"
