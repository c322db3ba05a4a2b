#!/usr/bin/env bash
# CPython 3.14 and an environment on it, for the extended tier's run of the fast check and the
# transfer tests on the Python of Neuron's 2.33 DLAMI (tests/test_python_versions.py):
#   bash scripts/python_env.sh   ->  ./.venv-py3.14
# No index here offers a 3.14 interpreter for this machine (Debian 12; Debian's own python3.14
# packages are built for newer releases), so CPython is built from Debian's copy of the upstream
# source, checked against the sha256 its signed Sources index gives, and cached in
# ${NEURON_DISAGG_CACHE:-$HOME/.cache/neuron-disagg}/python3.14 (about 5 minutes of a 2-core
# machine, once). The environment holds the package with its test extras and NIXL 1.4.1, not
# torch: no index here has a CPU build of torch for 3.14 (PyPI's CUDA build is 5 GB), and neither
# the package nor NIXL imports it. vLLM has no 3.14 build here either, so what needs vLLM or torch
# does not run there. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=3.14.7
TARBALL=python3.14_${VERSION}.orig.tar.xz
SHA256=3b48dac8fb59f62eaa67ac83c1eb12bda1b7a08406dd286e252c11a66be27f81
URL=http://deb.debian.org/debian/pool/main/p/python3.14/$TARBALL
CACHE=${NEURON_DISAGG_CACHE:-$HOME/.cache/neuron-disagg}
PREFIX=$CACHE/python$VERSION
VENV=.venv-py3.14
py=$VENV/bin/python
log() { echo "python_env.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

if [ ! -x "$PREFIX/bin/python3.14" ]; then
  missing=()
  for pkg in libssl-dev libffi-dev zlib1g-dev libbz2-dev liblzma-dev libsqlite3-dev; do
    dpkg -s "$pkg" > /dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get -q install -y "${missing[@]}" > /dev/null || die "could not apt-get install ${missing[*]}"
  fi
  work=$(mktemp -d "${TMPDIR:-/tmp}/python-env.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  curl -fsS --max-time 300 -o "$work/$TARBALL" "$URL" ||
    die "could not download $URL (Debian keeps only current versions in its pool: update VERSION and SHA256 from the python3.14 .dsc)"
  echo "$SHA256  $work/$TARBALL" | sha256sum -c --quiet - || die "$TARBALL does not match its sha256"
  tar -xf "$work/$TARBALL" -C "$work"
  (cd "$work/Python-$VERSION" && nice ./configure -q --prefix="$PREFIX" --with-ensurepip=install > /dev/null &&
     nice make -s -j2 > /dev/null 2>&1 && make -s install > /dev/null 2>&1) || die "building CPython $VERSION failed"
  "$PREFIX/bin/python3.14" -c "import ssl, ctypes, lzma, sqlite3, zlib, bz2" || die "CPython $VERSION lacks a module"
fi
if [ ! -f "$VENV/.neuron-disagg-ready" ]; then
  source scripts/uv.sh
  ensure_uv
  [ -x "$py" ] || "$PREFIX/bin/python3.14" -m venv "$VENV"
  # torch is NIXL's requirement only: overridden by a marker no interpreter matches.
  overrides=$(mktemp)
  echo 'torch; python_version < "0"' > "$overrides"
  uv_install "$py" --override "$overrides" -e '.[test]'
  rm -f "$overrides"
  touch "$VENV/.neuron-disagg-ready"
fi
"$py" -c "import sys, importlib.metadata as m; print(f'{sys.prefix}: Python {sys.version.split()[0]}, nixl {m.version(\"nixl\")}')"
