#!/bin/bash
# The systemd units neuron-disagg-prefill, -decode and -router, and the fabric environment they
# share. They are installed but not enabled: at boot, the user data written by `neuron-disagg launch`
# puts /etc/neuron-disagg/config.yaml, the root-only secret and the unit's arguments in place and
# starts the units this host's role needs.
set -euo pipefail

PLATFORM="${PLATFORM:?PLATFORM must be neuron or cuda}"
STAGE="${STAGE:-/tmp/neuron-disagg-ami}"

die() { echo "50-units: $*" >&2; exit 1; }

install -d -m 0755 /etc/neuron-disagg /opt/neuron-disagg/hf
for unit in prefill decode router; do
  install -m 0644 "$STAGE/units/neuron-disagg-$unit.service" /etc/systemd/system/
done

# Environment of every unit: libfabric's EFA provider with device RDMA, fork-safe (vLLM forks
# workers), shared-memory transfer off (it gave wrong output for disaggregation on one node).
library_path=/opt/amazon/efa/lib
if [[ "$PLATFORM" == neuron ]]; then
  library_path="/opt/neuron-disagg/lib:$library_path"  # what NIXL's LIBFABRIC plugin needs (40-fabric-libs.sh)
fi
cat > /etc/neuron-disagg/fabric.env << ENV
# Written by the neuron-disagg AMI build ($PLATFORM); read by every neuron-disagg unit.
FI_PROVIDER=efa
FI_EFA_USE_DEVICE_RDMA=1
FI_EFA_FORK_SAFE=1
FI_EFA_ENABLE_SHM_TRANSFER=0
LD_LIBRARY_PATH=$library_path
HF_HOME=/opt/neuron-disagg/hf
ENV
chmod 0644 /etc/neuron-disagg/fabric.env

systemctl daemon-reload
# Verify: systemd parses each unit and finds its command.
for unit in prefill decode router; do
  systemd-analyze verify "/etc/systemd/system/neuron-disagg-$unit.service" \
    || die "systemd rejects neuron-disagg-$unit.service"
done
echo "50-units: units installed (not enabled; the user data starts them)"
