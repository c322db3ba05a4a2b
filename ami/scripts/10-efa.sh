#!/bin/bash
# Install the EFA software (kernel module, rdma-core, libfabric with the efa provider) with AWS's
# installer at the pinned version EFA_VERSION (the template's efa_installer_version), unless the
# image already has that installer version or a newer one with a new enough libfabric
# (EFA_REINSTALL=1 forces it); and only after the tarball's GPG signature checks out against the key
# fingerprint AWS publishes (pinned below): the key is downloaded from the same place as the
# tarball, so the fingerprint is what makes the check mean something. The EFA installer version and
# libfabric version the image ends up with are recorded in VERSIONS_FILE.
set -euo pipefail

EFA_URL="${EFA_URL:-https://efa-installer.amazonaws.com}"
EFA_VERSION="${EFA_VERSION:-1.50.0}"  # what the DLAMIs of 2026-10 ship (their release notes' efa_version)
EFA_KEY_FINGERPRINT="${EFA_KEY_FINGERPRINT:-4E9091BCBB97A96B26B15E59A05480B1DD2D3CCC}"
EFA_PREFIX="${EFA_PREFIX:-/opt/amazon/efa}"  # where the installer puts libfabric (tests point it elsewhere)
MIN_LIBFABRIC="1.21"  # NIXL's LIBFABRIC plugin needs at least this (shared/notes/neuron-efa-aws.md)

EFA_INSTALLED="${EFA_INSTALLED:-/opt/amazon/efa_installed_packages}"  # the installer's own record
MODULES_LOAD_DIR="${MODULES_LOAD_DIR:-/etc/modules-load.d}"
PLATFORM="${PLATFORM:-}"
VERSIONS_FILE="${VERSIONS_FILE:-/etc/neuron-disagg/image-versions}"

die() { echo "10-efa: $*" >&2; exit 1; }

[[ "$EFA_VERSION" =~ ^[0-9]+(\.[0-9]+)+$ ]] || die "EFA_VERSION must be a version like 1.50.0 (pinned), not '$EFA_VERSION'"

libfabric_version() { "$EFA_PREFIX/bin/fi_info" --version 2> /dev/null | awk '/libfabric:/ { print $2; exit }'; }
at_least() {  # $1 >= $2, as versions
  [[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" == "$2" ]]
}
new_enough() { at_least "${1%%[a-z]*}" "$MIN_LIBFABRIC"; }  # $1: a libfabric version
installer_version() {  # what the installer's own record says ("# EFA installer version: 1.50.0")
  [[ -e "$EFA_INSTALLED" ]] && sed -n 's/^# EFA installer version: *//p' "$EFA_INSTALLED" | head -n1
}
record() {  # the image's versions, for whoever asks later what this AMI carries
  mkdir -p "$(dirname "$VERSIONS_FILE")"
  touch "$VERSIONS_FILE"
  sed -i '/^EFA_INSTALLER_VERSION=/d; /^LIBFABRIC_VERSION=/d' "$VERSIONS_FILE"
  printf 'EFA_INSTALLER_VERSION=%s\nLIBFABRIC_VERSION=%s\n' "$1" "$2" >> "$VERSIONS_FILE"
}
no_gpu_peermem() {
  # efa_nv_peermem serves GPUDirect RDMA; on a Trainium image it has no GPU driver to bind to and
  # its module-load entry fails at every boot.
  [[ "$PLATFORM" == "neuron" ]] || return 0
  local conf
  for conf in "$MODULES_LOAD_DIR"/*.conf; do
    [[ -e "$conf" ]] || continue
    if grep -q '^efa_nv_peermem' "$conf"; then
      sed -i '/^efa_nv_peermem/d' "$conf"
      echo "10-efa: removed efa_nv_peermem from $conf (no GPU on Trainium)"
    fi
  done
}

# The DLAMIs ship EFA already: reinstalling over it rebuilds the kernel module for nothing (and
# can leave the image's and the installer's packages disagreeing). Keep it if it is the pinned
# installer or newer, with a new enough libfabric; an older one is upgraded to the pinned one.
installed=$(libfabric_version || true)
image_installer=$(installer_version || true)
if [[ -n "$installed" && -n "$image_installer" ]] && new_enough "$installed" && at_least "$image_installer" "$EFA_VERSION" \
  && [[ "${EFA_REINSTALL:-0}" != 1 ]]; then
  echo "10-efa: the image's EFA is current (installer $image_installer >= pinned $EFA_VERSION, libfabric $installed" \
    "in $EFA_PREFIX): not reinstalling"
  record "$image_installer" "$installed"
  no_gpu_peermem
  exit 0
fi
if [[ -n "$image_installer" ]]; then
  echo "10-efa: the image has EFA installer $image_installer (libfabric ${installed:-unknown}): installing the pinned $EFA_VERSION"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
tarball="aws-efa-installer-${EFA_VERSION}.tar.gz"
curl -fsSLO "$EFA_URL/$tarball"
curl -fsSLO "$EFA_URL/$tarball.sig"
curl -fsSLO "$EFA_URL/aws-efa-installer.key"

# A keyring of our own, holding only AWS's EFA key.
export GNUPGHOME="$work/gnupg"
mkdir -m 0700 "$GNUPGHOME"
key_fpr=$(gpg --batch --with-colons --import-options show-only --import aws-efa-installer.key \
  | awk -F: '$1 == "fpr" { print $10; exit }')
[[ "$key_fpr" == "$EFA_KEY_FINGERPRINT" ]] \
  || die "the downloaded EFA key has fingerprint '$key_fpr', not AWS's published $EFA_KEY_FINGERPRINT: refusing to install"
gpg --batch --quiet --import aws-efa-installer.key
status=$(gpg --batch --status-fd 1 --verify "$tarball.sig" "$tarball" 2> /dev/null) \
  || die "the signature of $tarball does not verify: refusing to install"
grep -Eq "^\[GNUPG:\] VALIDSIG .* ${EFA_KEY_FINGERPRINT}\$" <<< "$status" \
  || die "$tarball is not signed by the EFA key $EFA_KEY_FINGERPRINT: refusing to install"
echo "10-efa: $tarball signature verified (key $EFA_KEY_FINGERPRINT)"

tar -xzf "$tarball"
(cd aws-efa-installer && ./efa_installer.sh --yes)

# Verify: the library NIXL loads is there and new enough.
[[ -e "$EFA_PREFIX/lib/libfabric.so.1" ]] || die "$EFA_PREFIX/lib/libfabric.so.1 missing after the install"
version=$(libfabric_version)
[[ -n "$version" ]] || die "fi_info did not report a libfabric version"
new_enough "$version" || die "libfabric $version is older than $MIN_LIBFABRIC, which NIXL needs"
echo "10-efa: EFA installer $EFA_VERSION: libfabric $version installed in $EFA_PREFIX"
record "$EFA_VERSION" "$version"
no_gpu_peermem
