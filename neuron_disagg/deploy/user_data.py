"""The boot script (EC2 user data) each instance runs once: write the neuron-disagg config, the
secret and the unit's arguments under /etc/neuron-disagg, then start the systemd units baked into
the AMI (ami/units/).

One script serves every instance of one RunInstances call: launch starts all instances of a type at
once (all or none, which a cluster placement group needs), so each learns its role and index from
its ``ami-launch-index``. The router's host learns every instance's address after they all exist:
launch tags it with them (``neuron-disagg:peers-*``) and it reads its own tags from the instance
metadata service, which needs no IAM permission.

Why user data rather than a config baked into the AMI: one AMI serves every deployment; what
differs per instance (role, model, peers' addresses) is only known at launch. The host's own IP is
filled in at boot from the instance metadata service, because the side channel must listen on, and
advertise, an address the peer can reach. The secret is not in the script: it reads it from the
deployment's SSM SecureString with the instance's role (see secret_parameter.py for why); only with
``secret_in_user_data`` does the script carry it. ``NEURON_DISAGG_ROOT`` prefixes every path and
``NEURON_DISAGG_RETRY_DELAY_S`` shortens the wait between reads, so that a test can run the script
in a scratch directory.
"""

from __future__ import annotations

import base64
import shlex
from typing import Literal

import yaml

from .settings import DeploymentConfig

Role = Literal["prefill", "decode"]
Member = tuple[Role, int]  # (role, index) of one instance of a launch
HOST_IP = "__HOST_IP__"  # replaced at boot by the instance's private IPv4 address
SECRET_READ_ATTEMPTS = 12  # 10 s apart: two minutes for the instance role's credentials to work
PEERS_TAG = "neuron-disagg:peers"  # -count: how many; -0, -1, ...: "role@ip" words, a tag value each
PEERS_READ_ATTEMPTS = 90  # 10 s apart: launch tags the router's host once every instance exists
TAG_VALUE_MAX = 256
_END = "NEURON_DISAGG_EOF"
FATAL_PREFIX = "neuron-disagg: FATAL:"  # the console line saying why a boot gave up (status.py reads it)

_HEADER = """#!/bin/bash
# neuron-disagg {members} of deployment {name}: written by `neuron-disagg launch`.
# Writes /etc/neuron-disagg/ (config.yaml, the root-only secret, each unit's arguments) and starts the
# systemd units baked into the AMI by ami/. Its output: /var/log/neuron-disagg-user-data.log
set -euo pipefail
ROOT="${{NEURON_DISAGG_ROOT:-}}"
ETC="$ROOT/etc/neuron-disagg"
mkdir -p "$ROOT/var/log"
exec > >(tee -a "$ROOT/var/log/neuron-disagg-user-data.log") 2>&1

# A host that cannot serve must not keep billing: on any failure, say why on the serial console
# (what `neuron-disagg status` reads back, with no IAM permission needed) and power off; launch set
# the shutdown behaviour to terminate.
FATAL=""
die() {{
  FATAL="$*"
  echo "neuron-disagg: $FATAL" >&2
  exit 1
}}
on_exit() {{
  local status=$?
  [[ "$status" == 0 ]] && return
  local reason="${{FATAL:-the boot script failed (exit $status); see /var/log/neuron-disagg-user-data.log}}"
  for console in "$ROOT/dev/console" "$ROOT/dev/ttyS0"; do
    [[ -w "$console" ]] && echo "{fatal} $reason" > "$console" 2> /dev/null || true
  done
  echo "neuron-disagg: powering off in a minute, which terminates this instance"
  shutdown -h +1 "neuron-disagg: boot failed" || poweroff
}}
trap on_exit EXIT

imds() {{  # IMDSv2: a session token first, then the value
  local token
  token=$(curl -fsS -X PUT http://169.254.169.254/latest/api/token \\
    -H 'X-aws-ec2-metadata-token-ttl-seconds: 300')
  curl -fsS -H "X-aws-ec2-metadata-token: $token" "http://169.254.169.254/latest/meta-data/$1"
}}
HOST_IP=$(imds local-ipv4)
if [[ ! "$HOST_IP" =~ ^[0-9.]+$ ]]; then
  die "could not read this host's private IPv4 address from the metadata service"
fi
install -d -m 0755 "$ETC"
# This instance's place in its launch: ami-launch-index counts the instances of one RunInstances call.
LAUNCH_INDEX=$(imds ami-launch-index)
case "$LAUNCH_INDEX" in
{cases}
  *) die "launch index '$LAUNCH_INDEX' is not one launch planned" ;;
esac
echo "neuron-disagg: this is $ROLE-$INDEX"
"""

_ROUTER = """
# The router runs here: every instance's address comes as this host's tags {tag}-*, set by launch
# once all exist, read from the instance metadata service (tags in metadata are enabled at launch).
if [[ "$ROLE-$INDEX" == {host} ]]; then
  for attempt in $(seq 1 {attempts}); do
    count=$(imds "tags/instance/{tag}-count" 2> /dev/null || true)
    peers=()
    if [[ "$count" =~ ^[0-9]+$ ]]; then
      i=0
      while part=$(imds "tags/instance/{tag}-$i" 2> /dev/null); do
        read -r -a words <<< "$part"
        peers+=("${{words[@]}}")
        i=$((i + 1))
      done
      [[ "${{#peers[@]}}" == "$count" ]] && break
    fi
    if [[ "$attempt" == {attempts} ]]; then
      die "launch never tagged this host with its peers ({tag}-*); is tags-in-metadata on?"
    fi
    sleep "${{NEURON_DISAGG_RETRY_DELAY_S:-10}}"
  done
  router_args="--host 0.0.0.0 --port {port}"
  for peer in "${{peers[@]}}"; do
    ip=${{peer#*@}}
    if [[ ! "$ip" =~ ^[0-9.]+$ ]]; then
      die "peer '$peer' is not role@IPv4"
    fi
    case "${{peer%%@*}}" in
      prefill) router_args+=" --prefill http://$ip:{prefill_port},tp={tp}" ;;
      decode) router_args+=" --decode http://$ip:{decode_port}" ;;
      *) die "peer '$peer' has no role" ;;
    esac
  done
  printf 'ROUTER_ARGS="%s"\n' "$router_args" > "$ETC/router.env"
  units+=(neuron-disagg-router)
fi
"""

_SECRET_INLINE = """
# The deployment secret (HMAC key for registrations), readable by root only.
install -m 0600 /dev/null "$ETC/secret"
base64 -d > "$ETC/secret" <<'{end}'
{encoded}
{end}
"""

_SECRET_SSM = """
# The deployment secret, read with this instance's role from SecureString {parameter}, root-only.
# Retried: the role's credentials can take a few seconds after boot (or after the role was created)
# to work. The value goes straight into the file, never to this log.
if ! command -v aws > /dev/null; then
  die "no aws command on this AMI to read the secret from SSM with (the DLAMIs ship it)"
fi
install -m 0600 /dev/null "$ETC/secret"
for attempt in $(seq 1 {attempts}); do
  if aws ssm get-parameter --region {region} --with-decryption --name {parameter} \\
      --query Parameter.Value --output text > "$ETC/secret" && [[ -s "$ETC/secret" ]]; then
    break
  fi
  if [[ "$attempt" == {attempts} ]]; then
    die "could not read the deployment secret from SecureString {parameter}: this instance's" \\
      "profile needs ssm:GetParameter on it and kms:Decrypt through SSM (examples/README.md, step 2)"
  fi
  echo "neuron-disagg: reading SecureString {parameter} failed (attempt $attempt of {attempts}); retrying" >&2
  sleep "${{NEURON_DISAGG_RETRY_DELAY_S:-10}}"
done
"""

_MAX_HOURS = """
# max_hours: this host powers off (and so terminates) {hours} h after its boot, whatever runs then.
shutdown -h +{minutes} "neuron-disagg: max_hours ({hours}) reached"
"""

_FILE = """
cat > "$ETC/{path}" <<'{end}'
{body}{end}
sed -i "s/{host_ip}/$HOST_IP/g" "$ETC/{path}"
"""

_START = """
for unit in "${units[@]}"; do
  if ! systemctl cat "$unit.service" > /dev/null 2>&1; then
    die "this AMI has no $unit.service: it is not a neuron-disagg AMI; bake one with ami/build.sh"
  fi
done
systemctl daemon-reload
for unit in "${units[@]}"; do
  systemctl enable --now "$unit.service"
done
echo "neuron-disagg: started ${units[*]}"
"""


def _env_file(values: dict[str, str]) -> str:
    """A systemd EnvironmentFile: one KEY="value" a line (values are plain words joined by spaces)."""
    return "".join(f'{key}="{value}"\n' for key, value in values.items())


def render(deployment: DeploymentConfig, members: list[Member], *, secret: bytes | None) -> str:
    """The user data of one launch: the instance with ami-launch-index k is ``members[k]``.
    ``secret`` is used only with ``secret_in_user_data``; it is None in a dry run (the script then
    says where the secret would go, never the secret)."""
    cases = "\n".join(f"  {k}) ROLE={role}; INDEX={index} ;;" for k, (role, index) in enumerate(members))
    names = ", ".join(f"{role}-{index}" for role, index in members)
    parts = [_HEADER.format(members=names, name=deployment.name, cases=cases, fatal=FATAL_PREFIX)]
    if deployment.max_hours:
        parts.append(_MAX_HOURS.format(hours=deployment.max_hours, minutes=max(1, round(deployment.max_hours * 60))))
    config = dict(deployment.instance_config(), side_channel_host=HOST_IP)
    parts.append(_FILE.format(path="config.yaml", end=_END, host_ip=HOST_IP,
                              body=yaml.safe_dump(config, sort_keys=True)))
    if not deployment.secret_in_user_data:
        parts.append(_SECRET_SSM.format(region=shlex.quote(deployment.region or ""), attempts=SECRET_READ_ATTEMPTS,
                                        parameter=shlex.quote(deployment.secret_parameter)))
    else:
        encoded = base64.b64encode(secret).decode() if secret is not None else "<secret, redacted in dry run>"
        parts.append(_SECRET_INLINE.format(end=_END, encoded=encoded))
    for role in sorted({role for role, _ in members}):
        port = deployment.prefill_port if role == "prefill" else deployment.decode_port
        parts.append(_FILE.format(path=f"{role}.env", end=_END, host_ip=HOST_IP, body=_env_file(
            {"MODEL": deployment.model, "VLLM_ARGS": " ".join(deployment.vllm_serve_args(port))})))
    parts.append('\nunits=("neuron-disagg-$ROLE")\n')
    if router_host(deployment) in members:
        parts.append(_ROUTER.format(host="-".join(map(str, router_host(deployment))), tag=PEERS_TAG,
                                    attempts=PEERS_READ_ATTEMPTS, port=deployment.router.port,
                                    prefill_port=deployment.prefill_port, decode_port=deployment.decode_port,
                                    tp=deployment.tensor_parallel_size))
    parts.append(_START)
    return "".join(parts)


def router_host(deployment: DeploymentConfig) -> Member:
    return (deployment.router.host, 0)


def peer_tags(members: list[tuple[Role, str]]) -> dict[str, str]:
    """The router host's tags naming every instance (role, private IP): words "role@ip", as many per
    tag as fit in a tag value, and their count."""
    words = [f"{role}@{ip}" for role, ip in members]
    values: list[str] = []
    for word in words:
        if values and len(values[-1]) + 1 + len(word) <= TAG_VALUE_MAX:
            values[-1] += " " + word
        else:
            values.append(word)
    return {f"{PEERS_TAG}-count": str(len(words)), **{f"{PEERS_TAG}-{i}": v for i, v in enumerate(values)}}
