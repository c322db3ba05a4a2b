#!/usr/bin/env bash
# The H200 device check (scripts/h200_check.py) on a GPU host without network, e.g. one lent by the
# project's device tool: Python 3.12 with a CUDA 13 build of torch (and numpy) already there.
#
#   bash scripts/h200_check.sh --fetch   # here, with network: NIXL's and msgspec's cp312 wheels into
#                                        # .device-wheels/ (55 MB; git ignores it: carry it over)
#   bash scripts/h200_check.sh           # there: install them --no-deps, check imports, run the check
# Extra arguments go to h200_check.py (e.g. --dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device-wheels
NIXL=1.5.0  # what the p5en image installs (ami/scripts/30-python.sh)
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = --fetch ]; then
  # The nixl meta package with --no-deps: it pins the CUDA 12 and 13 builds, and only 13 is wanted.
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" "nixl==$NIXL" "nixl-cu13==$NIXL" "msgspec>=0.18"
  du -sh "$WHEELS"
  exit 0
fi
[ -d "$WHEELS" ] || { echo "h200_check.sh: no $WHEELS: run 'bash scripts/h200_check.sh --fetch' where there is network" >&2; exit 2; }
"$PYTHON" -m pip install -q --no-deps --no-index "$WHEELS"/*.whl
"$PYTHON" - << 'PY'
import importlib, sys
missing = [m for m in ("torch", "numpy", "msgspec", "nixl") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"h200_check.sh: missing {', '.join(missing)}: torch and numpy must be installed; the rest comes from .device-wheels")
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
PY
exec "$PYTHON" scripts/h200_check.py "$@"
