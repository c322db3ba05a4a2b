#!/usr/bin/env bash
# Qwen3-32B on AWS as X prefill and Y decode hosts (1P1D by default), on Trainium2 or H200, each host
# cut into vLLM instances of TP 8 (8 on a trn2.48xlarge, 1 on a p5en.48xlarge: hosts in the config).
# Each prefill instance (P) pushes every prompt's KV cache straight into a decode instance's (D)
# memory over EFA; the router on the first P sends every request to a P and a D at once. More P for
# long prompts (prefill-bound), more D for many concurrent streams (decode-bound).
#
#   export AWS_REGION=us-east-2 SUBNET_ID=subnet-0123456789abcdef0
#   export NEURON_DISAGG_SECRET=$(openssl rand -hex 32)         # keep it: one secret per deployment
#   .venv/bin/neuron-disagg instance-profile examples/qwen3-32b.yaml --name qwen3-32b-trn2   # once per deployment
#   examples/launch.sh trn2.48xlarge            # 1P1D on trn2 (16 Trainium2 chips, 16 EFA cards each)
#   examples/launch.sh p5en.48xlarge            # 1P1D on p5en (8 H200 GPUs, 16 EFA cards each)
#   examples/launch.sh trn2.48xlarge 2 4        # 2P4D
#   DRY_RUN=1 examples/launch.sh trn2.48xlarge  # prints the AWS calls, makes none
#
# The instance type is the only difference between platforms: the model config is the same file,
# and each instance picks its platform at runtime. Optional: CAPACITY_BLOCK=cr-... (run inside a
# purchased Capacity Block, which must hold X+Y instances of the type), KEY_NAME=key pair,
# IAM_INSTANCE_PROFILE=name (default neuron-disagg-DEPLOYMENT, one per deployment: qwen3-32b-trn2,
# qwen3-32b-p5en, qwen3-32b-2p4d-trn2, ...), SECRET_IN_USER_DATA=1 (no instance profile: the secret
# goes into user data), YES=1 (launch without the cost confirmation), MAX_HOURS=H (every instance
# powers off, and terminates, H hours after its first boot; default 8, 0: never),
# HF_TOKEN_PARAMETER=/name (a SecureString holding a Hugging Face token, for a gated model),
# DEPLOYMENT=name, CONFIG=file, NEURON_DISAGG_VENV=path. examples/README.md walks through everything, including
# baking the AMI first; `neuron-disagg launch CONFIG --instance-type T --prefill X --decode Y
# --capacity-block-offerings 24` lists Capacity Block offers.
set -euo pipefail

usage="usage: examples/launch.sh INSTANCE_TYPE [X Y]   (e.g. examples/launch.sh trn2.48xlarge, or p5en.48xlarge 2 4)"
[[ $# -eq 1 || $# -eq 3 ]] || { echo "$usage" >&2; exit 2; }
[[ "$1" =~ ^[a-z0-9-]+\.[a-z0-9]+$ ]] || { echo "INSTANCE_TYPE must look like trn2.48xlarge; $usage" >&2; exit 2; }
INSTANCE_TYPE=$1
PREFILL=${2:-1}
DECODE=${3:-1}
[[ "$PREFILL" =~ ^[1-9][0-9]*$ && "$DECODE" =~ ^[1-9][0-9]*$ ]] || { echo "X and Y must be positive integers; $usage" >&2; exit 2; }
if [[ "$PREFILL$DECODE" != 11 ]]; then
  DEPLOYMENT="${DEPLOYMENT:-qwen3-32b-${PREFILL}p${DECODE}d-${INSTANCE_TYPE%%.*}}"
fi

# 1. Prerequisites, checked before any AWS call: the CLI, AWS credentials, region, subnet, the secret,
#    an instance profile to read it with.
# shellcheck source-path=SCRIPTDIR source=_preflight.sh
. "$(dirname "${BASH_SOURCE[0]}")/_preflight.sh"

# 2. Launch. In order: find the AMI (the one ami/build.sh baked, else the DLAMI), create or reuse the
#    cluster placement group and a security group open only to itself, then start every instance in
#    one all-or-none call, each with one EFA interface per network card. Their user data writes
#    /etc/neuron-disagg and starts the guard (a host that does not serve in time, or has run
#    max_hours, powers off), neuron-disagg-decode@k or neuron-disagg-prefill@k for each vLLM
#    instance of the host and (on the first P) neuron-disagg-router, which lists them all.
"$NEURON_DISAGG" launch "$CONFIG" --name "$DEPLOYMENT" --region "$AWS_REGION" --subnet "$SUBNET_ID" \
  --instance-type "$INSTANCE_TYPE" --prefill "$PREFILL" --decode "$DECODE" "${launch_flags[@]}"

# 3. What to do next. Booting, downloading the weights and loading them (compiling them, on
#    Trainium) takes a while; status shows the instances and the router's address meanwhile.
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0  # a dry run printed the calls as JSON lines; nothing to watch
cat << NEXT

next:
  $NEURON_DISAGG status $CONFIG --name $DEPLOYMENT
  send a request through the router: see examples/README.md, step 6
  $NEURON_DISAGG teardown $CONFIG --name $DEPLOYMENT     # stops the bill
NEXT
