#!/bin/bash
# vLLM, NIXL and neuron-disagg in one Python environment, linked at /opt/neuron-disagg/venv where the
# systemd units look.
#   neuron: the Neuron DLAMI's own vLLM environment (it holds vllm, vllm-neuron and torch-neuronx,
#           built for this Neuron SDK); we add NIXL and our package to it.
#   cuda:   a new environment with vLLM's CUDA build, NIXL and our package.
# NIXL is pinned (1.5.0): vLLM 0.33 and newer refuse NIXL < 1.5, and 1.5.1's LIBFABRIC plugin needs
# libfabric 2.7.0 (ABI FABRIC_1.10), newer than the pinned EFA installer 1.50.0 ships (2.6.0); 1.5.0's
# needs FABRIC_1.7.
set -euo pipefail

PLATFORM="${PLATFORM:?PLATFORM must be neuron or cuda}"
STAGE="${STAGE:-/tmp/neuron-disagg-ami}"
NIXL_VERSION="${NIXL_VERSION:-1.5.0}"
NEURON_PIP_INDEX="${NEURON_PIP_INDEX:-https://pip.repos.neuron.amazonaws.com}"
VENV_LINK=/opt/neuron-disagg/venv

die() { echo "30-python: $*" >&2; exit 1; }

shopt -s nullglob
wheels=("$STAGE"/neuron_disagg-*.whl)
shopt -u nullglob
[[ ${#wheels[@]} -eq 1 ]] || die "expected one neuron_disagg wheel in $STAGE, found ${#wheels[@]} (ami/build.sh builds it)"
wheel="${wheels[0]}"
mkdir -p /opt/neuron-disagg

case "$PLATFORM" in
  neuron)
    # The newest vLLM environment the DLAMI ships (named after its vLLM version).
    venv=$(find /opt -maxdepth 1 -type d -name 'aws_neuronx_venv_pytorch_inference_vllm*' | sort -V | tail -n1)
    [[ -n "$venv" ]] || die "no /opt/aws_neuronx_venv_pytorch_inference_vllm* on this AMI: use a Neuron DLAMI with vLLM (var neuron_ssm_parameter)"
    if ! "$venv/bin/python" -c 'import vllm_neuron' 2> /dev/null; then
      "$venv/bin/pip" install --extra-index-url "$NEURON_PIP_INDEX" vllm-neuron
    fi
    "$venv/bin/pip" install "${wheel}[neuron]" "nixl==${NIXL_VERSION}"
    ;;
  cuda)
    venv=/opt/neuron-disagg/venv-cuda
    python3 -m venv "$venv"
    "$venv/bin/pip" install --upgrade pip
    "$venv/bin/pip" install "${wheel}[cuda]" "nixl==${NIXL_VERSION}"
    ;;
  *)
    die "PLATFORM must be neuron or cuda, not $PLATFORM"
    ;;
esac
ln -sfn "$venv" "$VENV_LINK"

# Verify: each piece imports, vLLM is new enough (CVE-2026-22807), NIXL is the pinned version.
py="$VENV_LINK/bin/python"
"$py" -c 'import vllm' || die "vllm does not import"
if [[ "$PLATFORM" == neuron ]]; then
  "$py" -c 'import vllm_neuron' || die "vllm_neuron does not import"
fi
"$py" -c 'from neuron_disagg.vllm import compat; compat.check_version(compat.installed_version())' \
  || die "vLLM is outside the range neuron-disagg supports"
nixl=$("$py" -c 'import importlib.metadata as m; print(m.version("nixl"))')
[[ "$nixl" == "$NIXL_VERSION" ]] || die "nixl $nixl installed, expected $NIXL_VERSION"
"$py" -c 'from nixl._api import nixl_agent' || die "nixl's Python API does not import"
"$VENV_LINK/bin/neuron-disagg" --help > /dev/null || die "the neuron-disagg command does not run"
echo "30-python: $PLATFORM environment at $venv (linked from $VENV_LINK), nixl $nixl"
