#!/bin/bash
# Trainium hosts only: build the libcuda.so.1 stand-in that NIXL's LIBFABRIC plugin links against
# into /opt/neuron-disagg/lib, with the package's own set-up step (installed by 30-python.sh), which
# checks that each entry point answers CUDA_ERROR_NO_DEVICE. Only our units and `neuron-disagg
# serve` put that directory on LD_LIBRARY_PATH.
set -euo pipefail

LIB_DIR="${LIB_DIR:-/opt/neuron-disagg/lib}"
NEURON_DISAGG="${NEURON_DISAGG:-/opt/neuron-disagg/venv/bin/neuron-disagg}"

die() { echo "40-libcuda-stub: $*" >&2; exit 1; }

[[ "${PLATFORM:-}" == neuron ]] || die "the libcuda stub belongs on Neuron hosts only (PLATFORM=${PLATFORM:-unset})"
[[ -x "$NEURON_DISAGG" ]] || die "$NEURON_DISAGG is missing: 30-python.sh installs the package first"
if ! command -v cc > /dev/null && ! command -v gcc > /dev/null; then
  if command -v apt-get > /dev/null; then
    apt-get update
    apt-get install -y gcc
  else
    dnf install -y gcc
  fi
fi
"$NEURON_DISAGG" install-libcuda-stub --dir "$LIB_DIR"
