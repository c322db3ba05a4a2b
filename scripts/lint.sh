#!/usr/bin/env bash
# Lint and type-check, from the repository root:
#   ruff check   the package, cuda_compat/, tests/ and scripts/*.py ([tool.ruff] in pyproject.toml)
#   mypy         strict on neuron_disagg/protocol/, transfer/ and kv_params.py ([tool.mypy])
# Both run even when the first fails; exits non-zero on any finding and ends with one summary line.
# mypy keeps its cache in .mypy_cache/ (a warm run is a few seconds; a cold one reads torch's types).
set -uo pipefail
cd "$(dirname "$0")/.." || exit

start=$SECONDS
ruff_rc=0
mypy_rc=0
.venv/bin/ruff check neuron_disagg cuda_compat tests scripts/*.py || ruff_rc=$?
# The files and the strictness are pyproject.toml's [tool.mypy]; no paths here, so they stay in one place.
.venv/bin/mypy || mypy_rc=$?

ok() { [ "$1" -eq 0 ] && echo ok || echo "FAILED (exit $1)"; }
echo "lint.sh: ruff $(ok $ruff_rc), mypy $(ok $mypy_rc) in $((SECONDS - start)) s"
[ $ruff_rc -eq 0 ] && [ $mypy_rc -eq 0 ]
