#!/bin/bash
# What NIXL's LIBFABRIC plugin needs besides the EFA installer's libfabric, into /opt/neuron-disagg/lib
# with the package's own set-up step (installed by 30-python.sh), which then loads the LIBFABRIC
# backend to prove it:
#   neuron: a libcuda.so.1 stand-in (each entry point answers CUDA_ERROR_NO_DEVICE), the CUDA runtime
#           library from NVIDIA's wheel, hwloc's library from the distribution's package;
#   cuda:   the CUDA runtime library (the Python environment's own, else NVIDIA's wheel) and hwloc's
#           library, never a libcuda stub: the GPU DLAMI's NVIDIA driver provides libcuda.so.1 but
#           neither of the others where the linker looks.
# Nothing is installed system-wide: only our units (fabric.env) and `neuron-disagg serve` put that
# directory on LD_LIBRARY_PATH. The set-up step sees the units' library path and nothing inherited
# from the bake's shell, so what it finds the units find.
set -euo pipefail

LIB_DIR="${LIB_DIR:-/opt/neuron-disagg/lib}"
NEURON_DISAGG="${NEURON_DISAGG:-/opt/neuron-disagg/venv/bin/neuron-disagg}"
UNITS_LIBRARY_PATH="${UNITS_LIBRARY_PATH:-/opt/amazon/efa/lib}"  # fabric.env's, after LIB_DIR (50-units.sh)
export APT_LOCK_TIMEOUT_S="${APT_LOCK_TIMEOUT_S:-300}"  # install-fabric-libs's apt waits as long

die() { echo "40-fabric-libs: $*" >&2; exit 1; }

PLATFORM="${PLATFORM:-}"
[[ "$PLATFORM" == neuron || "$PLATFORM" == cuda ]] || die "PLATFORM must be neuron or cuda, not '${PLATFORM}'"
[[ -x "$NEURON_DISAGG" ]] || die "$NEURON_DISAGG is missing: 30-python.sh installs the package first"
# The libcuda stub is compiled (Neuron only). A fresh DLAMI may still be running its own apt jobs
# (unattended upgrades): apt waits for their lock rather than failing the bake.
if [[ "$PLATFORM" == neuron ]] && ! command -v cc > /dev/null && ! command -v gcc > /dev/null; then
  if command -v apt-get > /dev/null; then
    apt-get -o DPkg::Lock::Timeout="$APT_LOCK_TIMEOUT_S" update
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$APT_LOCK_TIMEOUT_S" install -y gcc
  else
    dnf install -y gcc
  fi
fi
LD_LIBRARY_PATH="$UNITS_LIBRARY_PATH" "$NEURON_DISAGG" install-fabric-libs --platform "$PLATFORM" --dir "$LIB_DIR"
if [[ "$PLATFORM" == cuda && -e "$LIB_DIR/libcuda.so.1" ]]; then
  die "$LIB_DIR/libcuda.so.1 exists: on a GPU host it would hide the NVIDIA driver's"
fi
