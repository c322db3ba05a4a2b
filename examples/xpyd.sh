#!/usr/bin/env bash
# Qwen3-32B (TP8) with X prefill and Y decode instances: more P for long prompts (prefill-bound),
# more D for many concurrent streams (decode-bound). The router runs on the first P and spreads
# requests by load.
#
#   examples/xpyd.sh 2 4                     # 2P4D on trn2.48xlarge
#   examples/xpyd.sh 1 3 p5en.48xlarge       # 1P3D on p5en
# Same environment as trn2_1p1d.sh (AWS_REGION, SUBNET_ID, NEURON_DISAGG_SECRET, IAM_INSTANCE_PROFILE,
# optional KEY_NAME, SECRET_IN_USER_DATA=1, CAPACITY_BLOCK, DEPLOYMENT, DRY_RUN=1). A Capacity Block must hold X+Y instances of one type;
# `neuron-disagg launch CONFIG --instance-type T --prefill X --decode Y --capacity-block-offerings 24`
# lists offers.
set -euo pipefail

usage="usage: examples/xpyd.sh X Y [INSTANCE_TYPE]   (e.g. examples/xpyd.sh 2 4 trn2.48xlarge)"
[[ $# -ge 2 && $# -le 3 ]] || { echo "$usage" >&2; exit 2; }
[[ "$1" =~ ^[1-9][0-9]*$ && "$2" =~ ^[1-9][0-9]*$ ]] || { echo "X and Y must be positive integers; $usage" >&2; exit 2; }
PREFILL=$1
DECODE=$2
INSTANCE_TYPE=${3:-trn2.48xlarge}
DEPLOYMENT="${DEPLOYMENT:-qwen3-32b-${PREFILL}p${DECODE}d-${INSTANCE_TYPE%%.*}}"

# 1. Prerequisites, checked before any AWS call.
# shellcheck source-path=SCRIPTDIR source=_preflight.sh
. "$(dirname "${BASH_SOURCE[0]}")/_preflight.sh"

# 2. Launch every D, then every P but the first, then the first P with the router, whose arguments
#    list every instance's address (launch orders this itself).
"$NEURON_DISAGG" launch "$CONFIG" --name "$DEPLOYMENT" --region "$AWS_REGION" --subnet "$SUBNET_ID" \
  --instance-type "$INSTANCE_TYPE" --prefill "$PREFILL" --decode "$DECODE" "${launch_flags[@]}"

# 3. Next steps: watch, use, remove.
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0  # a dry run printed the calls as JSON lines; nothing to watch
cat << NEXT

next:
  $NEURON_DISAGG status $CONFIG --name $DEPLOYMENT
  $NEURON_DISAGG teardown $CONFIG --name $DEPLOYMENT
NEXT
