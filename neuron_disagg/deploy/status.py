"""`neuron-disagg status`: the deployment's instances (found by tag) with state and addresses,
where the router listens, whether the secret's SSM parameter exists, why an instance that gave up
(its boot, its serving deadline, a unit that kept failing) or reached max_hours is shutting down or
gone, and what else of the deployment is left in the account (security and placement groups,
SecureStrings, the instance profile), so that a half-torn-down deployment is seen whole."""

from __future__ import annotations

import base64
import binascii
import json
from typing import TextIO

from . import instance_profile, network, secret_parameter
from .cloud import Cloud
from .errors import DeployError
from .inventory import LIVE_STATES, find_instances, summary
from .user_data import FATAL_PREFIX, STOP_PREFIX

COLUMNS = ["name", "instance_id", "role", "instance_type", "state", "private_ip", "public_ip", "zone"]


#: What a reason read from the console starts with: shown even for a terminated instance.
CONSOLE_REASONS = {FATAL_PREFIX: "gave up", STOP_PREFIX: "stopped"}


def status(cloud: Cloud, deployment: str, *, include_terminated: bool = False) -> list[dict[str, str]]:
    """The deployment's instances. One that is shutting down, stopped or terminated says why when its
    host gave up or reached max_hours (its console's FATAL or STOP line); terminated ones are listed
    only then, or with ``include_terminated``."""
    rows = []
    for instance in find_instances(cloud, deployment, LIVE_STATES + ["terminated"]):
        row = summary(instance)
        if row["state"] not in ("pending", "running"):
            row["reason"] = boot_failure(cloud, instance["InstanceId"]) or _state_reason(instance)
        said = row.get("reason", "").startswith(tuple(f"{word}:" for word in CONSOLE_REASONS.values()))
        if row["state"] != "terminated" or include_terminated or said:
            rows.append(row)
    return rows


def boot_failure(cloud: Cloud, instance_id: str) -> str:
    """Why the instance powered itself off, from the last FATAL or STOP line it wrote to the serial
    console (user_data.py, ami/boot/guard.sh); "" when it wrote none or the console cannot be read."""
    try:
        response = cloud.call("ec2", "GetConsoleOutput", InstanceId=instance_id, Latest=True)
    except DeployError:  # e.g. no permission to read it: the state still shows
        return ""
    output = (response or {}).get("Output") or ""
    try:
        text = base64.b64decode(output, validate=True).decode(errors="replace")  # as EC2 sends it
    except binascii.Error:
        text = output  # already plain (some emulators decode it)
    for line in reversed(text.splitlines()):
        for prefix, kind in CONSOLE_REASONS.items():
            if prefix in line:
                return f"{kind}: {line.split(prefix, 1)[1].strip()}"
    return ""


def resources(cloud: Cloud, deployment: str) -> list[str]:
    """What of the deployment exists besides its instances, one phrase each: its security groups (in
    any VPC), placement group, SecureStrings launch created, and instance profile. Each is what
    `teardown` removes; a lookup the credentials may not make is said, not raised."""
    name = network.resource_name(deployment)
    found = []
    try:
        found += [f"security group {name} ({g['GroupId']}, {g.get('VpcId', '?')})"
                  for g in network.find_security_groups(cloud, name, deployment=deployment)]
        if network.find_placement_group(cloud, name):
            found.append(f"placement group {name}")
    except DeployError as exc:
        found.append(f"security and placement groups: unknown ({exc})")
    found += [f"SecureString {parameter}" for parameter in secret_parameter.deployment_parameters(cloud, deployment)]
    try:
        if instance_profile.find_ours(cloud, deployment):
            found.append(f"instance profile and role {instance_profile.instance_role_name(deployment)}")
    except DeployError as exc:
        found.append(f"instance profile: unknown ({exc})")
    return found


def _state_reason(instance: dict) -> str:
    return instance.get("StateReason", {}).get("Message", "") or instance.get("StateTransitionReason", "")


def print_status(rows: list[dict[str, str]], deployment: str, router_port: int, out: TextIO,
                 as_json: bool = False, secret: tuple[str, str] | None = None,
                 left: list[str] | None = None) -> None:
    """``secret``: (SSM parameter name, what secret_parameter.describe_state said), when looked up;
    ``left``: ``resources``' phrases, when looked up."""
    if as_json:
        listing: dict = {"deployment": deployment, "instances": rows}
        if secret:
            listing["secret_parameter"] = {"name": secret[0], "state": secret[1]}
        if left is not None:
            listing["resources"] = left
        print(json.dumps(listing, indent=2), file=out)
        return
    secret_line = f"secret: SecureString {secret[0]} {secret[1]}" if secret else ""
    left_line = (f"also in the account: {'; '.join(left)} (`neuron-disagg teardown` removes them)" if left else "")
    if not rows:
        print(f"deployment {deployment}: no instances", file=out)
        for line in (secret_line, left_line):
            if line:
                print(line, file=out)
        return
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in COLUMNS}
    print("  ".join(c.upper().ljust(widths[c]) for c in COLUMNS), file=out)
    for row in rows:
        line = "  ".join(row[c].ljust(widths[c]) for c in COLUMNS)
        print(line + ("  <- router" if row["router"] == "yes" else ""), file=out)
    for row in rows:
        if row.get("reason"):
            print(f"{row['name']} ({row['instance_id']}) {row['state']}: {row['reason']}", file=out)
    router = next((r for r in rows if r["router"] == "yes" and r["state"] == "running"), None)
    if router:
        print(f"router: http://{router['private_ip']}:{router_port} (reachable only from the deployment's own "
              "instances: its security group admits nothing else; forward a port to it through SSM, "
              "examples/README.md step 6)", file=out)
    for line in (secret_line, left_line):
        if line:
            print(line, file=out)
