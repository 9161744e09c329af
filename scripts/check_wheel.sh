#!/usr/bin/env bash
# The package as a user installs it, without a checkout: builds the sdist and, from it, the
# deployment wheel (TRANSFORMER_EXT_DEPLOY=1: no compiled ops, no torch), installs the wheel with
# its [deploy] extra from the package index into a fresh virtual environment (pip's cache serves
# wheels it downloaded before) and translates the bundled demo model's ONNX export there, checking
# that torch is neither installed nor imported.
#
#     bash scripts/check_wheel.sh           # CI runs this (.ci/run)
#     bash scripts/check_wheel.sh --full    # also the full wheel (compiles the ops against the
#                                           # installed torch: minutes) into a fresh venv with torch
#
# PYTHON (default .venv/bin/python): the development environment that builds (it needs `build`)
# and exports the demo model. Everything is written into one temporary folder, removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
full=0
case "${1:-}" in
    "") ;;
    --full) full=1 ;;
    *) echo "check_wheel.sh: error: unknown argument '$1' (expected nothing or --full)" >&2; exit 2 ;;
esac
python=${PYTHON:-$repo/.venv/bin/python}
[ -x "$python" ] || { echo "check_wheel.sh: error: PYTHON=$python is not an executable Python" >&2; exit 2; }
version=$("$python" -c "import ast, sys; print(next(n.value.value for n in ast.parse(open(sys.argv[1]).read()).body if isinstance(n, ast.Assign) and n.targets[0].id == '__version__'))" transformer_ext/__init__.py)

work=$(mktemp -d "${TMPDIR:-/tmp}/check_wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
say() { echo "[check_wheel] $* ($(( $(date +%s) - start )) s)"; }

# The files git tracks, copied: the build writes its egg-info and build folders into its source.
mkdir "$work/src"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$work/src"

# sdist, then the wheel built from the unpacked sdist (what pip does with an sdist).
env -u PYTHONPATH TRANSFORMER_EXT_DEPLOY=1 "$python" -m build --no-isolation --outdir "$work/dist" "$work/src" \
    > "$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; exit 1; }
sdist="$work/dist/transformer_ext-$version.tar.gz"
wheel="$work/dist/transformer_ext-$version-py3-none-any.whl"
[ -f "$sdist" ] && [ -f "$wheel" ] || { ls "$work/dist"; echo "check_wheel.sh: error: expected $sdist and $wheel" >&2; exit 1; }
say "built $(basename "$sdist") and $(basename "$wheel")"

# The demo model's export, made by the development environment (export needs torch).
env -u PYTHONPATH "$python" -m export.onnx --output-dir "$work/export" --no-validate > "$work/export.log" 2>&1 \
    || { tail -n 40 "$work/export.log"; exit 1; }
say "exported the demo model"

# A fresh venv with the deployment install. Run from $work, so that no checkout is importable.
cd "$work"
"$python" -m venv "$work/deploy"
env -u PYTHONPATH "$work/deploy/bin/python" -m pip install --quiet "$wheel[deploy]"
say "installed the wheel with [deploy]"
got=$(env -u PYTHONPATH "$work/deploy/bin/transformer-ext-translate" --model "$work/export" "forty-two" "one thousand and one")
want=$'zweiundvierzig\neintausendeins'
[ "$got" = "$want" ] || { echo "check_wheel.sh: error: the deployment venv translated '$got', expected '$want'" >&2; exit 1; }
env -u PYTHONPATH "$work/deploy/bin/python" - "$work/export" "$version" <<'EOF'
import importlib.util
import sys

from transformer_ext.translate import Translator

import transformer_ext

assert transformer_ext.__version__ == sys.argv[2], (transformer_ext.__version__, sys.argv[2])
assert "site-packages" in transformer_ext.__file__, transformer_ext.__file__
assert Translator.from_export_dir(sys.argv[1]).translate(["forty-two"]) == ["zweiundvierzig"]
assert "torch" not in sys.modules, "the deployment install imported torch"
assert importlib.util.find_spec("torch") is None, "torch is installed in the deployment venv"
EOF
[ "$(env -u PYTHONPATH "$work/deploy/bin/transformer-ext-train" --version)" = "transformer-ext-train $version" ]
say "the deployment venv translates the demo export without torch"

if [ "$full" = 1 ]; then
    # The full wheel: the ops compiled against the development environment's torch, which the
    # wheel then requires exactly (setup.py); its fresh venv installs that torch from the index.
    rm -rf "$work/src/build" "$work/dist-full"
    env -u PYTHONPATH "$python" -m build --no-isolation --wheel --outdir "$work/dist-full" "$work/src" \
        > "$work/build-full.log" 2>&1 || { tail -n 40 "$work/build-full.log"; exit 1; }
    full_wheel=$(ls "$work"/dist-full/transformer_ext-"$version"-cp*.whl)
    say "built $(basename "$full_wheel")"
    "$python" -m venv "$work/full"
    env -u PYTHONPATH "$work/full/bin/python" -m pip install --quiet "$full_wheel"
    say "installed the full wheel"
    got=$(env -u PYTHONPATH "$work/full/bin/transformer-ext-translate" --runtime eager "forty-two")
    [ "$got" = "zweiundvierzig" ] || { echo "check_wheel.sh: error: the full venv translated '$got'" >&2; exit 1; }
    env -u PYTHONPATH "$work/full/bin/python" -c "import transformer_ext.ops as o, torch; print('ops from', o.__file__, 'torch', torch.__version__)"
    say "the full venv translates with the compiled ops"
fi
say "done"
