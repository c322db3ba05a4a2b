#!/usr/bin/env bash
# The extended tier, outside CI's 30 minutes: the tests marked `extended` (tests/conftest.py) — vLLM
# 0.24.0 (Neuron SDK 2.32's) served end to end, 0.24's and 0.33's vLLM-level tests, the bench end to
# end, the demo's corrupted-block control, the transfer tests on NIXL 1.5.1, and the fast check and
# transfer tests on Python 3.14 —
# in the environments this builds first (0.24's is ~6.5 GB: it runs on PyPI's CUDA build of torch
# 2.11, the only 2.11 reachable; 0.33's links 0.34's packages from uv's cache; Python 3.14 is built
# from source once, about 5 minutes). Run after scripts/setup.sh; record each pass in
# docs/verified.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/vllm_env.sh 0.24.0
bash scripts/vllm_env.sh 0.33.0
bash scripts/python_env.sh
bash scripts/nixl_env.sh 1.5.1
.venv/bin/python -m pytest -q -n 2 --extended -m extended "$@"
