#!/usr/bin/env bash
# An environment holding this package and one NIXL release, for the cross-process transfer tests'
# peers on that release (tests/integration/fabrics.py):
#   bash scripts/nixl_env.sh 1.5.1   ->  ./.venv-nixl-1.5.1
# The peers need no vLLM, so it holds none: NIXL, its torch requirement (the 2.13.0 CPU build on
# this machine's disk, linked from uv's cache) and the package, editable, so it tests the working
# tree. Idempotent: a second run with everything in place checks the import and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/nixl_env.sh NIXL_VERSION (e.g. 1.5.1)}
VENV=.venv-nixl-$VERSION
STAMP=$VENV/.neuron-disagg-ready
py=$VENV/bin/python
source scripts/uv.sh
check() {
  "$py" - "$VERSION" <<'PY'
import importlib.metadata, sys
import neuron_disagg, nixl  # noqa: F401
got = importlib.metadata.version("nixl")
assert got == sys.argv[1], f"nixl {got} installed, expected {sys.argv[1]}"
print(f"{sys.prefix}: nixl {got}, neuron-disagg from {neuron_disagg.__file__}")
PY
}
if [ -f "$STAMP" ] && check > /dev/null 2>&1; then
  check
  exit 0
fi
ensure_uv
[ -x "$py" ] || "${PYTHON:-python3}" -m venv "$VENV"
"$py" -c 'import torch' 2> /dev/null || uv_install "$py" "torch==2.13.0"
uv_install "$py" -e . "nixl==$VERSION"
check
touch "$STAMP"
