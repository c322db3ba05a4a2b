# Shared by the AWS example scripts (sourced, not run): check every prerequisite before the first
# AWS call, so a missing one fails in a second with a message instead of halfway through a launch.
# In:  INSTANCE_TYPE; the environment described in examples/README.md.
# Out: NEURON_DISAGG (the CLI), DEPLOYMENT, CONFIG, launch_flags (an array of extra launch flags).
# shellcheck shell=bash

examples_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$examples_dir")

fail() {
  echo "$(basename "$0"): $*" >&2
  exit 1
}

# The neuron-disagg CLI and its Python (the repository's venv unless NEURON_DISAGG_VENV says otherwise).
venv="${NEURON_DISAGG_VENV:-$repo/.venv}"
NEURON_DISAGG="$venv/bin/neuron-disagg"
[[ -x "$NEURON_DISAGG" ]] \
  || fail "no neuron-disagg at $NEURON_DISAGG: run scripts/setup.sh (or point NEURON_DISAGG_VENV at a venv with neuron-disagg installed)"
"$venv/bin/python" -c 'import boto3' 2> /dev/null \
  || fail "boto3 is missing from $venv: reinstall with '$venv/bin/pip install -e $repo'"

CONFIG="${CONFIG:-$examples_dir/qwen3-32b.yaml}"
DEPLOYMENT="${DEPLOYMENT:-qwen3-32b-${INSTANCE_TYPE%%.*}}"
AWS_REGION="${AWS_REGION:-${AWS_DEFAULT_REGION:-}}"
[[ -n "$AWS_REGION" ]] || fail "set AWS_REGION (e.g. export AWS_REGION=us-east-2), a region offering $INSTANCE_TYPE"
[[ -n "${SUBNET_ID:-}" ]] \
  || fail "set SUBNET_ID to a subnet in an Availability Zone with $INSTANCE_TYPE capacity (see examples/README.md, step 2)"
export AWS_REGION

launch_flags=()
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  launch_flags+=(--dry-run)  # prints the AWS calls; needs neither credentials nor the secret
else
  # Credentials as boto3 finds them (environment, ~/.aws, SSO, instance role); no AWS call is made here.
  "$venv/bin/python" -c 'import boto3, sys; sys.exit(boto3.Session().get_credentials() is None)' \
    || fail "no AWS credentials found: run 'aws configure' or 'aws sso login --profile P' and export AWS_PROFILE=P"
  secret="${NEURON_DISAGG_SECRET:-}"
  [[ ${#secret} -ge 16 ]] \
    || fail "set NEURON_DISAGG_SECRET to the deployment secret (at least 16 bytes): export NEURON_DISAGG_SECRET=\$(openssl rand -hex 32)"
fi
if [[ -n "${KEY_NAME:-}" ]]; then
  launch_flags+=(--key-name "$KEY_NAME")
fi
# The instances read the deployment secret from SSM with their instance profile's role: by default
# this deployment's own, neuron-disagg-$DEPLOYMENT, which `neuron-disagg instance-profile` creates
# (launch refuses one that cannot read this deployment's secret, saying so). Without a profile the
# secret can only travel in the user data, which must be asked for explicitly.
if [[ "${SECRET_IN_USER_DATA:-0}" == 1 ]]; then
  launch_flags+=(--secret-in-user-data)
else
  IAM_INSTANCE_PROFILE="${IAM_INSTANCE_PROFILE:-neuron-disagg-$DEPLOYMENT}"
  launch_flags+=(--iam-instance-profile "$IAM_INSTANCE_PROFILE")  # also for SSM port forwarding to the router
fi
# What it costs is printed before anything starts; the launch waits for a typed "yes", or YES=1.
if [[ "${YES:-0}" == 1 ]]; then
  launch_flags+=(--yes)
fi
if [[ -n "${MAX_HOURS:-}" ]]; then
  launch_flags+=(--max-hours "$MAX_HOURS")  # every instance powers off (terminates) this long after its first boot
fi
if [[ -n "${HF_TOKEN_PARAMETER:-}" ]]; then
  launch_flags+=(--hf-token-parameter "$HF_TOKEN_PARAMETER")  # a gated model: a SecureString you created
fi
if [[ -z "${KEY_NAME:-}" && -z "${IAM_INSTANCE_PROFILE:-}" ]]; then
  echo "note: neither IAM_INSTANCE_PROFILE nor KEY_NAME is set: nothing will reach the router on its" \
    "private address afterwards (see examples/README.md, step 2)" >&2
fi
if [[ -n "${CAPACITY_BLOCK:-}" ]]; then
  launch_flags+=(--capacity-block "$CAPACITY_BLOCK")
fi
