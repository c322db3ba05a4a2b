"""The boot script (EC2 user data) each instance runs once: write the neuron-disagg config, the
secret and each vLLM instance's arguments under /etc/neuron-disagg, arm the guard, then start the
systemd units baked into the AMI (ami/units/).

One script serves every instance of one RunInstances call: launch starts all instances of a type at
once (all or none, which a cluster placement group needs), so each learns its role and index from
its ``ami-launch-index``. The router's host learns every instance's address after they all exist:
launch tags it with them (``neuron-disagg:peers-*``) and it reads its own tags from the instance
metadata service, which needs no IAM permission.

A host runs several vLLM instances of its role (``sizing.py``): unit ``neuron-disagg-<role>@<k>``
reads ``<role>-<k>.env`` (the model; vLLM's arguments, with port role_port + k; which accelerators
are its own) and ``<role>-<k>.yaml`` (the config, with side-channel ports of its own).

The guard (``neuron-disagg-guard``, ami/boot/guard.sh) is what keeps a host that boots but cannot
serve from billing: this script only starts units, which says nothing of whether they will ever
serve. It reads ``guard.env``, written here once: the /health URLs of every instance on the host (and
of the router), how long after each boot they must all answer, and ``STOP_AT``, max_hours as an
absolute time, so that a reboot neither forgets it nor starts it afresh. A unit that keeps failing
stops being restarted and has the guard power the host off too (the units' ``OnFailure=``).

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

import yaml

from ..kv_params import Role
from .settings import DeploymentConfig
from .sizing import VISIBLE, HostPlan

Member = tuple[Role, int]  # (role, index) of one instance of a launch
HOST_IP = "__HOST_IP__"  # replaced at boot by the instance's private IPv4 address
SECRET_READ_ATTEMPTS = 12  # 10 s apart: two minutes for the instance role's credentials to work
PEERS_TAG = "neuron-disagg:peers"  # -count: how many; -0, -1, ...: "role@ip" words, a tag value each
PEERS_READ_ATTEMPTS = 90  # 10 s apart: launch tags the router's host once every instance exists
TAG_VALUE_MAX = 256
_END = "NEURON_DISAGG_EOF"
FATAL_PREFIX = "neuron-disagg: FATAL:"  # the console line saying why a host gave up (status.py reads it)
STOP_PREFIX = "neuron-disagg: STOP:"  # the console line of a host that reached max_hours (ami/boot/guard.sh)

_HEADER = """#!/bin/bash
# neuron-disagg {members} of deployment {name}: written by `neuron-disagg launch`.
# Writes /etc/neuron-disagg/ (config files, the root-only secret, each vLLM instance's arguments, the
# guard's settings) and starts the systemd units baked into the AMI by ami/. Its output:
# /var/log/neuron-disagg-user-data.log
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
BOOT_EPOCH=$(awk '$1 == "btime" {{print $2}}' "$ROOT/proc/stat")
if [[ ! "$BOOT_EPOCH" =~ ^[0-9]+$ ]]; then
  die "could not read this host's boot time from /proc/stat"
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

_FILE = """
cat > "$ETC/{path}" <<'{end}'
{body}{end}
sed -i "s/{host_ip}/$HOST_IP/g" "$ETC/{path}"
"""

_SECRET_INLINE = """
# The deployment secret (HMAC key for registrations), readable by root only.
install -m 0600 /dev/null "$ETC/secret"
base64 -d > "$ETC/secret" <<'{end}'
{encoded}
{end}
"""

_FETCH = """
# SecureStrings are read with this instance's role. Retried: the role's credentials can take a few
# seconds after boot (or after the role was created) to work. A value goes straight into a root-only
# file, never to this log.
if ! command -v aws > /dev/null; then
  die "no aws command on this AMI to read SecureStrings from SSM with (the DLAMIs ship it)"
fi
fetch_secure_string() {{  # $1: the parameter, $2: the file it goes to, $3: what it is
  local attempt
  install -m 0600 /dev/null "$2"
  for attempt in $(seq 1 {attempts}); do
    if aws ssm get-parameter --region {region} --with-decryption --name "$1" \\
        --query Parameter.Value --output text > "$2" && [[ -s "$2" ]]; then
      return 0
    fi
    if [[ "$attempt" == {attempts} ]]; then
      die "could not read $3 from SecureString $1: this instance's" \\
        "profile needs ssm:GetParameter on it and kms:Decrypt through SSM (examples/README.md, step 2)"
    fi
    echo "neuron-disagg: reading SecureString $1 failed (attempt $attempt of {attempts}); retrying" >&2
    sleep "${{NEURON_DISAGG_RETRY_DELAY_S:-10}}"
  done
}}
"""

_SECRET_SSM = """
# The deployment secret (HMAC key for registrations), from SecureString {parameter}, root-only.
fetch_secure_string {parameter} "$ETC/secret" "the deployment secret"
"""

_HF_TOKEN = """
# The Hugging Face token, from SecureString {parameter}, into the vLLM units' environment (hf.env,
# root-only): without it every start of a gated model fails at its download.
fetch_secure_string {parameter} "$ETC/hf-token" "the Hugging Face token"
if ! grep -Eqx '[A-Za-z0-9_-]+' "$ETC/hf-token"; then
  rm -f "$ETC/hf-token"
  die "SecureString {parameter} does not hold a Hugging Face token (one word of letters, digits, _ and -)"
fi
install -m 0600 /dev/null "$ETC/hf.env"
printf 'HF_TOKEN=%s\\n' "$(cat "$ETC/hf-token")" > "$ETC/hf.env"
rm -f "$ETC/hf-token"
"""

_ROLE = """
# {role}: {describe}. Instance k: port {port} + k, side-channel ports {side} + k x {tp} + rank.
if [[ "$ROLE" == {role} ]]; then
  for ((k = 0; k < {n}; k++)); do
    first=$((k * {tp}))
    last=$((first + {tp} - 1))
    {devices}
    {{ cat "$ETC/config.yaml"; echo "side_channel_port: $(({side} + k * {tp}))"; }} > "$ETC/{role}-$k.yaml"
    {{
      printf 'MODEL="%s"\\n' {model}
      printf 'VLLM_ARGS="--host 0.0.0.0 --port %s %s"\\n' "$(({port} + k))" {args}
      printf '{visible}="%s"\\n' "$devices"
    }} > "$ETC/{role}-$k.env"
    units+=("neuron-disagg-{role}@$k")
    checks+=("http://127.0.0.1:$(({port} + k))/health")
  done
fi
"""

_ROUTER = """
# The router runs here: every instance's address comes as this host's tags {tag}-*, set by launch
# once all exist, read from the instance metadata service (tags in metadata are enabled at launch).
# Every host of a role holds the same instances: the router lists each of each host.
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
      prefill)
        for ((k = 0; k < {p_n}; k++)); do
          router_args+=" --prefill http://$ip:$(({p_port} + k)),side_channel=$ip:$(({side} + k * {p_tp})),tp={p_tp}"
        done
        ;;
      decode)
        for ((k = 0; k < {d_n}; k++)); do
          router_args+=" --decode http://$ip:$(({d_port} + k)),side_channel=$ip:$(({side} + k * {d_tp})),tp={d_tp}"
        done
        ;;
      *) die "peer '$peer' has no role" ;;
    esac
  done
  printf 'ROUTER_ARGS="%s"\\n' "$router_args" > "$ETC/router.env"
  units+=(neuron-disagg-router)
  checks+=("http://127.0.0.1:{port}/health")
fi
"""

_GUARD = """
# The guard powers this host off if the instances above (and the router) do not all answer /health
# within {deadline_min} min of a boot, and {max_hours}.
{stop_at}
{{
  echo "SERVE_WITHIN_S={deadline_s}"
  echo "CHECKS=\\"${{checks[*]}}\\""
  echo "STOP_AT=$stop_at"
  echo "MAX_HOURS={hours}"
}} > "$ETC/guard.env"
"""

_START = """
units=(neuron-disagg-guard "${units[@]}")
for unit in "${units[@]}"; do
  if ! systemctl cat "$unit.service" > /dev/null 2>&1; then
    die "this AMI has no $unit.service: it is not a neuron-disagg AMI; bake one with ami/build.sh"
  fi
done
systemctl daemon-reload
for unit in "${units[@]}"; do
  systemctl enable --now "$unit.service"
done
echo "neuron-disagg: started ${units[*]}; the guard powers this host off if they do not serve"
"""


def render(deployment: DeploymentConfig, members: list[Member], *, secret: bytes | None,
           hosts: dict[str, HostPlan], deadline_s: int) -> str:
    """The user data of one launch: the instance with ami-launch-index k is ``members[k]``. ``hosts``:
    each role's plan (``sizing.plans``; the router's host needs both roles'); ``deadline_s``: how long
    after each boot the host must serve (``sizing.serving_deadline_s`` of its platform).
    ``secret`` is used only with ``secret_in_user_data``; it is None in a dry run (the script then
    says where the secret would go, never the secret)."""
    cases = "\n".join(f"  {k}) ROLE={role}; INDEX={index} ;;" for k, (role, index) in enumerate(members))
    names = ", ".join(f"{role}-{index}" for role, index in members)
    parts = [_HEADER.format(members=names, name=deployment.name, cases=cases, fatal=FATAL_PREFIX)]
    config = dict(deployment.instance_config(), side_channel_host=HOST_IP)
    config.pop("side_channel_port", None)  # each vLLM instance has its own, below
    parts.append(_FILE.format(path="config.yaml", end=_END, host_ip=HOST_IP,
                              body=yaml.safe_dump(config, sort_keys=True)))
    if deployment.parameters_read_at_boot:
        parts.append(_FETCH.format(region=shlex.quote(deployment.region or ""), attempts=SECRET_READ_ATTEMPTS))
    if not deployment.secret_in_user_data:
        parts.append(_SECRET_SSM.format(parameter=shlex.quote(deployment.secret_parameter)))
    else:
        encoded = base64.b64encode(secret).decode() if secret is not None else "<secret, redacted in dry run>"
        parts.append(_SECRET_INLINE.format(end=_END, encoded=encoded))
    if deployment.hf_token_ssm_parameter:
        parts.append(_HF_TOKEN.format(parameter=shlex.quote(deployment.hf_token_ssm_parameter)))
    parts.append("\nunits=()\nchecks=()\n")
    side = deployment.neuron_disagg.side_channel_port
    for role in sorted({role for role, _ in members}):
        host = hosts[role]
        port = deployment.prefill_port if role == "prefill" else deployment.decode_port
        devices = ('devices=$(seq -s, "$first" "$last")' if host.platform == "cuda" else
                   'devices=$first; [[ "$last" == "$first" ]] || devices="$first-$last"')
        parts.append(_ROLE.format(
            role=role, describe=host.describe(), n=host.instances, tp=host.tensor_parallel_size, devices=devices,
            side=side, port=port, visible=VISIBLE[host.platform], model=shlex.quote(deployment.model),
            args=shlex.quote(" ".join(deployment.vllm_serve_args(host.tensor_parallel_size)))))
    if router_host(deployment) in members:
        p, d = hosts["prefill"], hosts["decode"]
        parts.append(_ROUTER.format(host="-".join(map(str, router_host(deployment))), tag=PEERS_TAG,
                                    attempts=PEERS_READ_ATTEMPTS, port=deployment.router.port, side=side,
                                    p_n=p.instances, p_tp=p.tensor_parallel_size, p_port=deployment.prefill_port,
                                    d_n=d.instances, d_tp=d.tensor_parallel_size, d_port=deployment.decode_port))
    minutes = max(1, round(deployment.max_hours * 60)) if deployment.max_hours else 0
    parts.append(_GUARD.format(
        deadline_min=deadline_s // 60, deadline_s=deadline_s, hours=f"{deployment.max_hours:g}",
        stop_at=f"stop_at=$((BOOT_EPOCH + {minutes} * 60))" if minutes else 'stop_at=""',
        max_hours=(f"{deployment.max_hours:g} h after the first boot (max_hours: an absolute time, written once, "
                   "that reboots keep)" if minutes else "never for max_hours (max_hours: 0)")))
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
