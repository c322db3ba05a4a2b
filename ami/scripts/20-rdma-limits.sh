#!/bin/bash
# RDMA needs to pin (lock) the memory it registers: KV caches are tens of GiB, far beyond the
# default locked-memory limit of a few MiB. Lift it for logins (limits.d) and for every systemd
# service (our units also say LimitMEMLOCK=infinity themselves).
set -euo pipefail

die() { echo "20-rdma-limits: $*" >&2; exit 1; }

cat > /etc/security/limits.d/90-neuron-disagg-memlock.conf << 'LIMITS'
# neuron-disagg: RDMA (EFA) registers the KV cache, which must stay locked in memory.
*    soft memlock unlimited
*    hard memlock unlimited
root soft memlock unlimited
root hard memlock unlimited
LIMITS

mkdir -p /etc/systemd/system.conf.d
cat > /etc/systemd/system.conf.d/90-neuron-disagg-memlock.conf << 'SYSTEMD'
[Manager]
DefaultLimitMEMLOCK=infinity
SYSTEMD
systemctl daemon-reexec

# Verify: the service manager's default, and what a freshly started service really gets.
manager_limit=$(systemctl show --property DefaultLimitMEMLOCK --value)
[[ "$manager_limit" == "infinity" ]] || die "systemd's DefaultLimitMEMLOCK is $manager_limit"
service_limit=$(systemd-run --wait --pipe --quiet bash -c 'ulimit -l')
[[ "$service_limit" == "unlimited" ]] || die "a service still gets memlock $service_limit"
echo "20-rdma-limits: memlock unlimited for logins and services"
