"""`neuron-disagg status`: the deployment's instances (found by tag) with state and addresses,
where the router listens, whether the secret's SSM parameter exists, and why an instance whose
boot gave up is shutting down or gone."""

from __future__ import annotations

import base64
import binascii
import json
from typing import TextIO

from .cloud import Cloud
from .errors import DeployError
from .inventory import LIVE_STATES, find_instances, summary
from .user_data import FATAL_PREFIX

COLUMNS = ["name", "instance_id", "role", "instance_type", "state", "private_ip", "public_ip", "zone"]


def status(cloud: Cloud, deployment: str, *, include_terminated: bool = False) -> list[dict[str, str]]:
    """The deployment's instances. One that is shutting down, stopped or terminated says why when its
    boot script gave up (its console's FATAL line); terminated ones are listed only then, or with
    ``include_terminated``."""
    rows = []
    for instance in find_instances(cloud, deployment, LIVE_STATES + ["terminated"]):
        row = summary(instance)
        if row["state"] not in ("pending", "running"):
            row["reason"] = boot_failure(cloud, instance["InstanceId"]) or _state_reason(instance)
        if row["state"] != "terminated" or include_terminated or row.get("reason", "").startswith("boot failed"):
            rows.append(row)
    return rows


def boot_failure(cloud: Cloud, instance_id: str) -> str:
    """Why the instance's boot script gave up, from the FATAL line it wrote to the serial console
    (user_data.py); "" when it wrote none or the console cannot be read."""
    try:
        response = cloud.call("ec2", "GetConsoleOutput", InstanceId=instance_id, Latest=True)
    except DeployError:  # e.g. no permission to read it: the state still shows
        return ""
    output = (response or {}).get("Output") or ""
    try:
        text = base64.b64decode(output, validate=True).decode(errors="replace")  # as EC2 sends it
    except binascii.Error:
        text = output  # already plain (some emulators decode it)
    lines = [line for line in text.splitlines() if FATAL_PREFIX in line]
    return f"boot failed: {lines[-1].split(FATAL_PREFIX, 1)[1].strip()}" if lines else ""


def _state_reason(instance: dict) -> str:
    return instance.get("StateReason", {}).get("Message", "") or instance.get("StateTransitionReason", "")


def print_status(rows: list[dict[str, str]], deployment: str, router_port: int, out: TextIO,
                 as_json: bool = False, secret: tuple[str, str] | None = None) -> None:
    """``secret``: (SSM parameter name, what secret_parameter.describe_state said), when looked up."""
    if as_json:
        listing: dict = {"deployment": deployment, "instances": rows}
        if secret:
            listing["secret_parameter"] = {"name": secret[0], "state": secret[1]}
        print(json.dumps(listing, indent=2), file=out)
        return
    secret_line = f"secret: SecureString {secret[0]} {secret[1]}" if secret else ""
    if not rows:
        print(f"deployment {deployment}: no instances", file=out)
        if secret_line:
            print(secret_line, file=out)
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
        print(f"router: http://{router['private_ip']}:{router_port} (reachable from inside the VPC; see "
              "examples/README.md for a port forward)", file=out)
    if secret_line:
        print(secret_line, file=out)
