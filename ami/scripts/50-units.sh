#!/bin/bash
# The systemd units neuron-disagg-prefill@ and -decode@ (one instance per vLLM server of a host),
# -router, the fabric environment they share, neuron-disagg-model-cache (the prefill and decode units
# want it: at boot it moves HF_HOME onto local NVMe instance store where the instance has some;
# ami/boot/model-cache.sh), and what powers off a host that cannot serve: neuron-disagg-guard (the
# serving deadline and max_hours) and neuron-disagg-fatal@ (a unit systemd stopped restarting), both
# ami/boot/guard.sh. They are installed but not enabled: at boot, the user data written by
# `neuron-disagg launch` puts /etc/neuron-disagg/ in place and starts the guard and the units this
# host's role needs.
set -euo pipefail

PLATFORM="${PLATFORM:?PLATFORM must be neuron or cuda}"
STAGE="${STAGE:-/tmp/neuron-disagg-ami}"

die() { echo "50-units: $*" >&2; exit 1; }

UNITS=(prefill@ decode@ router model-cache guard fatal@)
install -d -m 0755 /etc/neuron-disagg /opt/neuron-disagg/hf /opt/neuron-disagg/bin
for unit in "${UNITS[@]}"; do
  install -m 0644 "$STAGE/units/neuron-disagg-$unit.service" /etc/systemd/system/
done
install -m 0755 "$STAGE/boot/model-cache.sh" /opt/neuron-disagg/bin/neuron-disagg-model-cache
install -m 0755 "$STAGE/boot/guard.sh" /opt/neuron-disagg/bin/neuron-disagg-guard

# What the model-cache script runs: mdadm to stripe several instance-store devices, mkfs.xfs.
missing=()
command -v mdadm > /dev/null || missing+=(mdadm)
command -v mkfs.xfs > /dev/null || missing+=(xfsprogs)
if [[ ${#missing[@]} -gt 0 ]]; then
  if command -v apt-get > /dev/null; then
    apt-get -o DPkg::Lock::Timeout=300 update  # a fresh DLAMI may still be running its own apt jobs
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y "${missing[@]}"
  else
    dnf install -y "${missing[@]}"
  fi
fi

# Environment of every unit: libfabric's EFA provider with device RDMA, fork-safe (vLLM forks
# workers), shared-memory transfer off (it gave wrong output for disaggregation on one node); the
# libraries NIXL's LIBFABRIC plugin needs besides libfabric (40-fabric-libs.sh: on Neuron a libcuda
# stub, the CUDA runtime and hwloc; on GPU hosts the CUDA runtime and hwloc beside the driver's
# libcuda) first, then the EFA installer's libfabric; the model cache on the root volume unless
# model-cache.env (read after this file) moves it to local NVMe.
cat > /etc/neuron-disagg/fabric.env << ENV
# Written by the neuron-disagg AMI build ($PLATFORM); read by every neuron-disagg unit.
FI_PROVIDER=efa
FI_EFA_USE_DEVICE_RDMA=1
FI_EFA_FORK_SAFE=1
FI_EFA_ENABLE_SHM_TRANSFER=0
LD_LIBRARY_PATH=/opt/neuron-disagg/lib:/opt/amazon/efa/lib
HF_HOME=/opt/neuron-disagg/hf
ENV
chmod 0644 /etc/neuron-disagg/fabric.env

systemctl daemon-reload
# Verify: systemd parses each unit and finds its command (a template through one of its instances);
# mdadm and mkfs.xfs are there.
for unit in "${UNITS[@]}"; do
  name="neuron-disagg-${unit/%@/@0}.service"
  systemd-analyze verify "$name" || die "systemd rejects $name"
done
if ! command -v mdadm > /dev/null || ! command -v mkfs.xfs > /dev/null; then
  die "mdadm or mkfs.xfs is missing after installing them"
fi
echo "50-units: units installed (not enabled; the user data starts them)"
