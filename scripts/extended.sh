#!/usr/bin/env bash
# The extended tier, outside CI's 30 minutes: the tests marked `extended` (vLLM 0.24.0, Neuron SDK
# 2.32's, served end to end and its vLLM-level tests), in the environment this builds first
# (~6.5 GB: 0.24 runs on PyPI's CUDA build of torch 2.11, the only 2.11 reachable). Run after
# scripts/setup.sh; record a pass's date and commit in docs/verified.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/vllm_env.sh 0.24.0
.venv/bin/python -m pytest -q -n 2 --extended -m extended "$@"
