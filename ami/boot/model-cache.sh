#!/bin/bash
# At boot (neuron-disagg-model-cache.service, which the prefill and decode units want and start
# after): put the model cache (HF_HOME) on the instance's local NVMe instance store where it has
# one (trn2.48xlarge: 4 x 1.9 TB; p5en.48xlarge: 8 x 3.84 TB) instead of the root EBS volume. In order:
#   1. the DLAMI's own mount of the instance store, if mounted (the GPU DLAMI's release notes give
#      nvme_location /opt/dlami/nvme): used as it is, never reformatted;
#   2. our own mount at $MOUNT_POINT, or our filesystem from an earlier boot (label nd-models: a
#      reboot keeps instance store, a stop/start erases it), mounted again;
#   3. instance-store devices (/dev/disk/by-id/nvme-Amazon_EC2_NVMe_Instance_Storage_*) that all
#      hold nothing (blkid finds no signature): one is formatted, several are striped first (RAID0,
#      mdadm), then mounted at $MOUNT_POINT;
#   4. otherwise (no instance store, or devices holding someone else's data): nothing at all, and
#      HF_HOME stays where fabric.env puts it (/opt/neuron-disagg/hf, on the root volume).
# The result is /run/neuron-disagg/model-cache.env (HF_HOME=...), which those units read after
# fabric.env. /run starts empty at each boot, so it never names a cache that is gone.
# NEURON_DISAGG_ROOT prefixes every path (the tests run this against a fake /dev tree).
set -euo pipefail

ROOT="${NEURON_DISAGG_ROOT:-}"
DLAMI_MOUNT="${DLAMI_MOUNT:-/opt/dlami/nvme}"
MOUNT_POINT="${MOUNT_POINT:-/opt/neuron-disagg/nvme}"
DLAMI_WAIT_S="${DLAMI_WAIT_S:-60}"  # a DLAMI mounts its instance store itself, perhaps a little later
LABEL=nd-models                     # at most 12 characters (XFS)
MD_NAME=neuron-disagg-models
ENV_FILE="$ROOT/run/neuron-disagg/model-cache.env"

log() { echo "neuron-disagg-model-cache: $*"; }

use() {  # $1: a mounted directory; the cache goes into it and the units are told
  local cache="$1/neuron-disagg/hf"
  install -d -m 0755 "$ROOT$cache" "$(dirname "$ENV_FILE")"
  printf '# Written at boot by neuron-disagg-model-cache (local NVMe instance store)\nHF_HOME=%s\n' "$cache" \
    > "$ENV_FILE.tmp"
  mv "$ENV_FILE.tmp" "$ENV_FILE"
  log "model cache (HF_HOME) on local NVMe instance store: $cache"
  exit 0
}

blank() { # $1: a device; blkid -p exits 2 when it finds no signature (filesystem, RAID, LVM, partitions)
  local rc=0
  blkid -p "$1" > /dev/null 2>&1 || rc=$?
  [[ $rc -eq 2 ]]
}

rm -f "$ENV_FILE"

# The instance-store devices, each once: by-id holds several names for one device (namespace
# suffixes), and partitions are not devices to use.
shopt -s nullglob
devices=()
declare -A seen=()
for link in "$ROOT"/dev/disk/by-id/nvme-Amazon_EC2_NVMe_Instance_Storage_*; do
  [[ "$link" == *-part* ]] && continue
  device=$(readlink -f "$link")
  [[ -e "$device" && -z "${seen[$device]:-}" ]] || continue
  seen[$device]=1
  devices+=("$device")
done
shopt -u nullglob
if [[ ${#devices[@]} -eq 0 ]]; then
  log "no NVMe instance store on this instance: the model cache stays on the root volume"
  exit 0
fi
mapfile -t devices < <(printf '%s\n' "${devices[@]}" | sort -V)

# 1. The DLAMI's mount (waiting a little where the DLAMI's mount point exists but is not mounted yet).
if [[ -d "$ROOT$DLAMI_MOUNT" ]]; then
  for ((waited = 0; waited < DLAMI_WAIT_S; waited++)); do
    mountpoint -q "$ROOT$DLAMI_MOUNT" && break
    sleep 1
  done
  if mountpoint -q "$ROOT$DLAMI_MOUNT"; then
    use "$DLAMI_MOUNT"
  fi
fi

# 2. Ours, mounted or from an earlier boot.
if mountpoint -q "$ROOT$MOUNT_POINT"; then
  use "$MOUNT_POINT"
fi
all_blank=1
for device in "${devices[@]}"; do
  blank "$device" || all_blank=0
done
label="$ROOT/dev/disk/by-label/$LABEL"
if [[ $all_blank -eq 0 && ! -e "$label" && ${#devices[@]} -gt 1 ]]; then
  mdadm --assemble --scan > /dev/null 2>&1 || true  # udev normally has, but not always this early
  udevadm settle || true
fi
if [[ -e "$label" ]]; then
  mkdir -p "$ROOT$MOUNT_POINT"
  mount -o noatime "$label" "$ROOT$MOUNT_POINT"
  use "$MOUNT_POINT"
fi

# 3. Blank devices: ours to format.
if [[ $all_blank -eq 0 ]]; then
  log "the instance-store devices (${devices[*]}) hold data that is not ours and nothing has mounted" \
    "them at $DLAMI_MOUNT: leaving them alone; the model cache stays on the root volume"
  exit 0
fi
if [[ ${#devices[@]} -eq 1 ]]; then
  target="${devices[0]}"
else
  target="$ROOT/dev/md/$MD_NAME"
  mdadm --create "$target" --run --level=0 --raid-devices="${#devices[@]}" --name="$MD_NAME" "${devices[@]}"
  udevadm settle || true
fi
if command -v mkfs.xfs > /dev/null; then
  mkfs.xfs -q -f -K -L "$LABEL" "$target"  # -K: instance store comes trimmed; discarding TBs takes minutes
else
  mkfs.ext4 -q -F -E nodiscard,lazy_itable_init=1 -L "$LABEL" "$target"
fi
mkdir -p "$ROOT$MOUNT_POINT"
mount -o noatime "$target" "$ROOT$MOUNT_POINT"
log "${#devices[@]} instance-store device(s) (${devices[*]}) formatted and mounted at $MOUNT_POINT"
use "$MOUNT_POINT"
