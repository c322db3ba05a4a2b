#!/usr/bin/env bash
# Make NIXL's LIBFABRIC backend usable on a CPU-only Debian 12 machine (this project's kind), for
# tests that move KV through libfabric's tcp provider inside a private network namespace.
#
# Installs, into ${NEURON_DISAGG_CACHE:-$HOME/.cache/neuron-disagg}/libfabric/lib:
#   libfabric.so.1   libfabric 2.1.0 (tcp provider built in), from Debian trixie's upstream
#                    tarball: nixl 1.4.1's plugin needs ABI FABRIC_1.7, bookworm ships 1.17. On
#                    trn2/p5en the EFA installer's libfabric takes its place.
#   and whatever else NIXL's LIBFABRIC plugin lacks here, put there by the package's own set-up step
#   for Neuron hosts (`neuron-disagg install-fabric-libs`, platforms/fabric_libs.py): the libcuda
#   stub and libhwloc.so.15 on this machine (its CUDA 13 runtime is found where it is).
# Idempotent and cached: a second run does no network and no build. Prints, as its last line,
# LIBFABRIC_LIBS=<dir>; a process that uses LIBFABRIC needs LD_LIBRARY_PATH=<dir> and
# FI_PROVIDER=tcp (and FI_TCP_IFACE=<veth> inside the test's namespace: tcp ignores loopback).
# With NEURON_DISAGG_FABRIC_BUILD_ONLY=1 it stops after libfabric itself, which needs no .venv
# (setup.sh builds it while .venv installs). Otherwise run it as root, after setup.sh made .venv (it may apt-get install autoconf automake
# libtool); CPU work runs under nice.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${NEURON_DISAGG_CACHE:-$HOME/.cache/neuron-disagg}
PREFIX=$CACHE/libfabric
LIBDIR=$PREFIX/lib
SRCDIR=$CACHE/src

FABRIC_VERSION=2.1.0
FABRIC_TARBALL=libfabric_${FABRIC_VERSION}.orig.tar.xz
# From the InRelease-signed Sources index of Debian trixie (libfabric 2.1.0-1.1).
FABRIC_SHA256=1a66369772d5bb151737214af1c478993e969cf298e8f9ed369e7a2ab8d8c6df
FABRIC_URL=http://deb.debian.org/debian/pool/main/libf/libfabric/$FABRIC_TARBALL
FABRIC_STAMP=$PREFIX/.libfabric-$FABRIC_VERSION-$FABRIC_SHA256
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
FABRIC_LIBS_STAMP=$LIBDIR/.neuron-disagg-fabric-libs  # written by fabric_libs.py once the backend loads

log() { echo "libfabric.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

fabric_ok() { [ -f "$FABRIC_STAMP" ] && [ -e "$LIBDIR/libfabric.so.1" ]; }
stub_current() {  # as libcuda_stub.py stamps it
  [ ! -e "$LIBDIR/libcuda.so.1" ] ||
    [ -f "$LIBDIR/.built-from-$(sha256sum "$REPO/neuron_disagg/platforms/libcuda_stub.c" | cut -c1-16)" ]
}
have_all() { fabric_ok && [ -f "$FABRIC_LIBS_STAMP" ] && stub_current; }

# Warm path: everything in place, nothing to lock, fetch or build.
if have_all; then
  echo "LIBFABRIC_LIBS=$LIBDIR"
  exit 0
fi

mkdir -p "$LIBDIR" "$SRCDIR"
exec 9> "$CACHE/.libfabric.lock"
flock 9  # two runs at once: the second waits, then finds the work done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/libfabric-sh.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export DEBIAN_FRONTEND=noninteractive

APT_UPDATED=
apt_get() {  # the machine's own apt sources; one 'apt-get update' if the lists are stale
  if ! apt-get -q -o APT::Sandbox::User=root "$@"; then
    [ -z "$APT_UPDATED" ] || return 1
    APT_UPDATED=1
    apt-get -q update > /dev/null
    apt-get -q -o APT::Sandbox::User=root "$@"
  fi
}

need_gcc() {
  if ! command -v gcc > /dev/null || ! command -v make > /dev/null; then
    apt_get install -y --no-install-recommends gcc make libc6-dev > /dev/null
  fi
}

fetch_fabric_tarball() {
  local dest=$SRCDIR/$FABRIC_TARBALL
  if [ -f "$dest" ] && echo "$FABRIC_SHA256  $dest" | sha256sum -c --quiet - 2> /dev/null; then
    return
  fi
  rm -f "$dest"
  log "downloading $FABRIC_TARBALL"
  if ! curl -fsSL --retry 3 -o "$WORK/$FABRIC_TARBALL" "$FABRIC_URL"; then
    # The pool URL moves only if Debian drops 2.1.0; apt then finds whichever suite still has it.
    # Its source index comes from a private sources list: /etc/apt is left alone.
    log "pool URL failed; asking apt for trixie's source package"
    local apt=$WORK/apt
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/dl"
    echo "deb-src http://deb.debian.org/debian trixie main" > "$apt/sources.list"
    local opts=(-q -o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root)
    apt-get "${opts[@]}" update > /dev/null
    # The Debian diff tarball and .dsc may 404; only the upstream tarball matters.
    (cd "$apt/dl" && apt-get "${opts[@]}" source --download-only libfabric >&2 || true)
    mv "$apt/dl/$FABRIC_TARBALL" "$WORK/$FABRIC_TARBALL" || die "apt did not fetch $FABRIC_TARBALL"
  fi
  echo "$FABRIC_SHA256  $WORK/$FABRIC_TARBALL" | sha256sum -c --quiet - ||
    die "$FABRIC_TARBALL does not match its pinned sha256"
  mv "$WORK/$FABRIC_TARBALL" "$dest"
}

build_fabric() {
  fetch_fabric_tarball
  if ! command -v autoreconf > /dev/null || ! command -v automake > /dev/null ||
    ! command -v libtoolize > /dev/null; then
    log "installing autoconf automake libtool"
    apt_get install -y --no-install-recommends autoconf automake libtool > /dev/null
  fi
  need_gcc
  log "building libfabric $FABRIC_VERSION (a few minutes on 2 busy cores)"
  tar -xJf "$SRCDIR/$FABRIC_TARBALL" -C "$WORK"
  (
    cd "$WORK/libfabric-$FABRIC_VERSION"
    [ -x configure ] || nice -n 19 ./autogen.sh > "$WORK/autogen.log" 2>&1 ||
      { tail -30 "$WORK/autogen.log" >&2; exit 1; }
    nice -n 19 ./configure --prefix="$PREFIX" --enable-tcp --enable-sockets --disable-efa \
      --disable-verbs --disable-psm2 --disable-psm3 --disable-opx --disable-usnic --disable-shm \
      --disable-rxm --disable-rxd --disable-ucx --disable-lpp --disable-cxi --disable-static \
      > "$WORK/configure.log" 2>&1 || { tail -30 "$WORK/configure.log" >&2; exit 1; }
    nice -n 19 make -j2 > "$WORK/make.log" 2>&1 || { tail -30 "$WORK/make.log" >&2; exit 1; }
    make install > "$WORK/install.log" 2>&1 || { tail -30 "$WORK/install.log" >&2; exit 1; }
  )
  "$PREFIX/bin/fi_info" -l 2> /dev/null | grep -q '^tcp:' || die "built libfabric has no tcp provider"
  touch "$FABRIC_STAMP"
}

fabric_libs() {
  [ -x "$PYTHON" ] || die "$PYTHON is missing: run scripts/setup.sh first"
  need_gcc  # the libcuda stub is compiled
  LD_LIBRARY_PATH=$LIBDIR nice -n 19 "$PYTHON" -m neuron_disagg.platforms.fabric_libs --dir "$LIBDIR" >&2
}

fabric_ok || build_fabric
if [ -n "${NEURON_DISAGG_FABRIC_BUILD_ONLY:-}" ]; then  # setup.sh: ./.venv is not ready yet
  exit 0
fi
fabric_libs
have_all || die "set-up incomplete"
echo "LIBFABRIC_LIBS=$LIBDIR"
