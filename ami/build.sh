#!/bin/bash
# Bake the neuron-disagg AMIs: check the DLAMI and the builder's network, build this package's wheel,
# then run Packer on ami/.
#   ami/build.sh                       # both AMIs (Trainium and H200), in the default VPC
#   ami/build.sh -only=amazon-ebs.neuron -var subnet_id=subnet-...     # a private subnet (NAT gateway)
#   ami/build.sh -var builder_connect=public_ip -var subnet_id=subnet-...  # a public subnet, no plugin
# Needs: Packer >= 1.9 (https://developer.hashicorp.com/packer/install), the Session Manager plugin
# (unless builder_connect=public_ip), AWS credentials allowed to run EC2 instances, create images and
# create the builder's temporary instance profile, and the repository's venv (scripts/setup.sh).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
python="${PYTHON:-$repo/.venv/bin/python}"

die() { echo "ami/build.sh: $*" >&2; exit 1; }

command -v packer > /dev/null || die "packer is not installed: https://developer.hashicorp.com/packer/install"
[[ -x "$python" ]] || die "no Python at $python: run scripts/setup.sh first, or set PYTHON"
"$python" -c 'import boto3, sys; sys.exit(boto3.Session().get_credentials() is None)' \
  || die "no AWS credentials found: run 'aws configure' or 'aws sso login', or export AWS_PROFILE"

# Before anything bills: the pinned Neuron SDK's DLAMI exists here (or say which releases do), and
# Packer can reach the builder and the builder the internet (neuron_disagg/deploy/bake.py).
"$python" -m neuron_disagg.deploy.bake "$@" || die "not baking: see above"

# The wheel of exactly this checkout.
dist="$repo/dist"
rm -f "$dist"/neuron_disagg-*.whl
"$python" -m pip wheel --no-deps --quiet --wheel-dir "$dist" "$repo"
wheel=$(find "$dist" -maxdepth 1 -name 'neuron_disagg-*.whl' | head -n1)
[[ -n "$wheel" ]] || die "building the wheel produced nothing in $dist"

packer init "$here"
packer validate -var "wheel=$wheel" "$@" "$here"
packer build -var "wheel=$wheel" "$@" "$here"
