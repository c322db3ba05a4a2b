#!/bin/bash
# Last step of the bake: `neuron-disagg doctor` checks the host end to end (devices, EFA, NIXL's
# LIBFABRIC plugin, vLLM). If it fails, the build fails: an AMI that cannot serve is worse than none.
set -euo pipefail

# --image: a baked image has no deployment secret yet (each instance gets it at launch);
# --platform: the builder has none of the target's devices, so name it. NIXL's LIBFABRIC backend
# must load for it, with the libraries 40-fabric-libs.sh installed (Neuron: libcuda stub, CUDA
# runtime, hwloc; GPU: CUDA runtime and hwloc beside the driver's libcuda), and the plugin must
# resolve all it needs with exactly the units' LD_LIBRARY_PATH (fabric.env).
DOCTOR_COMMAND="${DOCTOR_COMMAND:-neuron-disagg doctor --image --platform ${PLATFORM:?PLATFORM must be neuron or cuda}}"

# The same environment the units run with.
set -a
# shellcheck source=/dev/null
. /etc/neuron-disagg/fabric.env
set +a
export PATH="/opt/neuron-disagg/venv/bin:/opt/amazon/efa/bin:$PATH"  # fi_info: the EFA installer's

echo "90-doctor: running: $DOCTOR_COMMAND"
read -r -a command <<< "$DOCTOR_COMMAND"
if ! "${command[@]}"; then
  echo "90-doctor: '$DOCTOR_COMMAND' failed: this AMI would not serve; see its output above" >&2
  exit 1
fi
