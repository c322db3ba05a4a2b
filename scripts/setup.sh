#!/usr/bin/env bash
# Install everything the demo and the test suite need into ./.venv. Idempotent: a second run only
# checks. Works on a fresh machine of this project's kind (Python 3.10+, PyPI reachable).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -c 'import neuron_disagg, msgspec, hypothesis; print("neuron-disagg", neuron_disagg.__version__, "ready in .venv")'
