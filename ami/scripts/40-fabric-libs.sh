#!/bin/bash
# Trainium hosts only: what NIXL's LIBFABRIC plugin needs besides the EFA installer's libfabric — a
# libcuda.so.1 stand-in (each entry point answers CUDA_ERROR_NO_DEVICE), the CUDA runtime library
# from NVIDIA's wheel and hwloc's library from the distribution's package — into
# /opt/neuron-disagg/lib, with the package's own set-up step (installed by 30-python.sh), which loads
# the LIBFABRIC backend to prove it. Nothing is installed system-wide: only our units and
# `neuron-disagg serve` put that directory on LD_LIBRARY_PATH.
set -euo pipefail

LIB_DIR="${LIB_DIR:-/opt/neuron-disagg/lib}"
NEURON_DISAGG="${NEURON_DISAGG:-/opt/neuron-disagg/venv/bin/neuron-disagg}"

die() { echo "40-fabric-libs: $*" >&2; exit 1; }

[[ "${PLATFORM:-}" == neuron ]] || die "these libraries belong on Neuron hosts only (PLATFORM=${PLATFORM:-unset})"
[[ -x "$NEURON_DISAGG" ]] || die "$NEURON_DISAGG is missing: 30-python.sh installs the package first"
if ! command -v cc > /dev/null && ! command -v gcc > /dev/null; then
  if command -v apt-get > /dev/null; then
    apt-get update
    apt-get install -y gcc
  else
    dnf install -y gcc
  fi
fi
LD_LIBRARY_PATH="/opt/amazon/efa/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  "$NEURON_DISAGG" install-fabric-libs --dir "$LIB_DIR"
