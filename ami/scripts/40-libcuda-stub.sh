#!/bin/bash
# Trainium hosts only: build the libcuda.so.1 stand-in that NIXL's LIBFABRIC plugin links against
# (see ../libcuda_stub.c for why) into /opt/neuron-disagg/lib, which only our units put on
# LD_LIBRARY_PATH.
set -euo pipefail

STAGE="${STAGE:-/tmp/neuron-disagg-ami}"
LIB_DIR="${LIB_DIR:-/opt/neuron-disagg/lib}"

die() { echo "40-libcuda-stub: $*" >&2; exit 1; }

[[ "${PLATFORM:-}" == neuron ]] || die "the libcuda stub belongs on Neuron hosts only (PLATFORM=${PLATFORM:-unset})"
if ! command -v gcc > /dev/null; then
  apt-get update
  apt-get install -y gcc
fi
mkdir -p "$LIB_DIR"
gcc -shared -fPIC -O2 -Wall -Wextra -Werror -Wl,-soname,libcuda.so.1 \
  -o "$LIB_DIR/libcuda.so.1" "$STAGE/libcuda_stub.c"

# Verify: the three entry points are exported and each answers CUDA_ERROR_NO_DEVICE (100).
for symbol in cuCtxSetCurrent cuDeviceGetPCIBusId cuPointerGetAttributes; do
  nm -D --defined-only "$LIB_DIR/libcuda.so.1" | grep -qw "$symbol" || die "$symbol is not exported"
done
python3 - "$LIB_DIR/libcuda.so.1" << 'PY'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
buf = ctypes.create_string_buffer(16)
answers = [lib.cuCtxSetCurrent(None), lib.cuDeviceGetPCIBusId(buf, 16, 0),
           lib.cuPointerGetAttributes(0, None, None, ctypes.c_ulonglong(0))]
sys.exit(0 if answers == [100, 100, 100] else f"stub answered {answers}, expected 100 each")
PY
echo "40-libcuda-stub: $LIB_DIR/libcuda.so.1 built and checked"
