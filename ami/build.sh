#!/bin/bash
# Bake the neuron-disagg AMIs: build this package's wheel, then run Packer on ami/.
#   ami/build.sh                       # both AMIs (Trainium and H200)
#   ami/build.sh -only=amazon-ebs.neuron -var subnet_id=subnet-...
# Needs: Packer >= 1.9 (https://developer.hashicorp.com/packer/install), AWS credentials allowed to
# run EC2 instances and create images, and the repository's venv (scripts/setup.sh) for the wheel.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
python="${PYTHON:-$repo/.venv/bin/python}"

die() { echo "ami/build.sh: $*" >&2; exit 1; }

command -v packer > /dev/null || die "packer is not installed: https://developer.hashicorp.com/packer/install"
[[ -x "$python" ]] || die "no Python at $python: run scripts/setup.sh first, or set PYTHON"
"$python" -c 'import boto3, sys; sys.exit(boto3.Session().get_credentials() is None)' \
  || die "no AWS credentials found: run 'aws configure' or 'aws sso login', or export AWS_PROFILE"

# The wheel of exactly this checkout.
dist="$repo/dist"
rm -f "$dist"/neuron_disagg-*.whl
"$python" -m pip wheel --no-deps --quiet --wheel-dir "$dist" "$repo"
wheel=$(find "$dist" -maxdepth 1 -name 'neuron_disagg-*.whl' | head -n1)
[[ -n "$wheel" ]] || die "building the wheel produced nothing in $dist"

packer init "$here"
packer validate -var "wheel=$wheel" "$@" "$here"
packer build -var "wheel=$wheel" "$@" "$here"
