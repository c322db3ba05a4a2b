"""`neuron-disagg status`: the deployment's instances (found by tag) with state and addresses,
where the router listens, and whether the secret's SSM parameter exists."""

from __future__ import annotations

import json
from typing import TextIO

from .cloud import Cloud
from .inventory import LIVE_STATES, find_instances, summary

COLUMNS = ["name", "instance_id", "role", "instance_type", "state", "private_ip", "public_ip", "zone"]


def status(cloud: Cloud, deployment: str, *, include_terminated: bool = False) -> list[dict[str, str]]:
    states = LIVE_STATES + ["terminated"] if include_terminated else None
    return [summary(i) for i in find_instances(cloud, deployment, states)]


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
    router = next((r for r in rows if r["router"] == "yes" and r["state"] == "running"), None)
    if router:
        print(f"router: http://{router['private_ip']}:{router_port} (reachable from inside the VPC; see "
              "examples/README.md for a port forward)", file=out)
    if secret_line:
        print(secret_line, file=out)
