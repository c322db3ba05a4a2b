#!/usr/bin/env bash
# Qwen3-32B (TP8) as one prefill and one decode instance on AWS Trainium2: trn2.48xlarge (16 Trainium2 chips, 16 EFA cards).
# The prefill instance (P) pushes each prompt's KV cache straight into the decode instance's (D)
# memory over EFA; the router on P's host sends every request to both at once.
#
#   export AWS_REGION=us-east-2 SUBNET_ID=subnet-0123456789abcdef0 IAM_INSTANCE_PROFILE=neuron-disagg
#   export NEURON_DISAGG_SECRET=$(openssl rand -hex 32)   # keep it: the same secret for the whole deployment
#   examples/trn2_1p1d.sh              # DRY_RUN=1 examples/trn2_1p1d.sh prints the AWS calls, makes none
#
# IAM_INSTANCE_PROFILE's role reads the secret from SSM at boot (examples/README.md, step 2, creates it).
# Optional: CAPACITY_BLOCK=cr-... (run inside a purchased Capacity Block), KEY_NAME=key pair,
# SECRET_IN_USER_DATA=1 (no instance profile: the secret goes into user data), DEPLOYMENT=name,
# NEURON_DISAGG_VENV=path. examples/README.md walks through everything, including baking the AMI first.
# This script differs from p5en_1p1d.sh only in INSTANCE_TYPE: same model config, and each
# instance picks its platform at runtime.
set -euo pipefail

INSTANCE_TYPE=trn2.48xlarge

# 1. Prerequisites, checked before any AWS call: the CLI, AWS credentials, region, subnet, the secret,
#    an instance profile to read it with.
# shellcheck source-path=SCRIPTDIR source=_preflight.sh
. "$(dirname "${BASH_SOURCE[0]}")/_preflight.sh"

# 2. Launch. In order: find the AMI (the one ami/build.sh baked, else the DLAMI), create or reuse the
#    cluster placement group and a security group open only to itself, then start D and finally P,
#    each with one EFA interface per network card. Their user data writes /etc/neuron-disagg and
#    starts neuron-disagg-decode, neuron-disagg-prefill and (on P) neuron-disagg-router.
"$NEURON_DISAGG" launch "$CONFIG" --name "$DEPLOYMENT" --region "$AWS_REGION" --subnet "$SUBNET_ID" \
  --instance-type "$INSTANCE_TYPE" --prefill 1 --decode 1 "${launch_flags[@]}"

# 3. What to do next. Booting, downloading the weights and loading them (compiling them, on
#    Trainium) takes a while; status shows the instances and the router's address meanwhile.
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0  # a dry run printed the calls as JSON lines; nothing to watch
cat << NEXT

next:
  $NEURON_DISAGG status $CONFIG --name $DEPLOYMENT
  send a request through the router: see examples/README.md, step 6
  $NEURON_DISAGG teardown $CONFIG --name $DEPLOYMENT     # stops the bill
NEXT
