"""Finding a deployment's instances by tag: what status lists and teardown terminates.

Why tags and no local state file: any machine with the credentials and the config can see and
remove a deployment, and nothing is lost when a laptop is.
"""

from __future__ import annotations

from typing import Any

from .cloud import Cloud

DEPLOYMENT_TAG = "neuron-disagg:deployment"
LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


def tag_list(tags: dict[str, str]) -> list[dict[str, str]]:
    return [{"Key": key, "Value": value} for key, value in sorted(tags.items())]


def tags_of(resource: dict[str, Any]) -> dict[str, str]:
    return {tag["Key"]: tag["Value"] for tag in resource.get("Tags", [])}


def find_instances(cloud: Cloud, deployment: str, states: list[str] | None = None) -> list[dict[str, Any]]:
    """Instances tagged with the deployment, in ``states`` (default: every state but terminated)."""
    filters = [{"Name": f"tag:{DEPLOYMENT_TAG}", "Values": [deployment]},
               {"Name": "instance-state-name", "Values": states or LIVE_STATES}]
    instances: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        page = cloud.call("ec2", "DescribeInstances", Filters=filters, **({"NextToken": token} if token else {}))
        if page is None:
            return []
        instances += [i for reservation in page.get("Reservations", []) for i in reservation.get("Instances", [])]
        token = page.get("NextToken")
        if not token:
            return sorted(instances, key=_order)


def _order(instance: dict[str, Any]) -> tuple:
    tags = tags_of(instance)
    return (tags.get("neuron-disagg:role", ""), int(tags.get("neuron-disagg:index", "0") or 0), instance["InstanceId"])


def summary(instance: dict[str, Any]) -> dict[str, str]:
    """The fields status shows, flat, for a table or JSON."""
    tags = tags_of(instance)
    return {
        "name": tags.get("Name", ""),
        "instance_id": instance["InstanceId"],
        "role": tags.get("neuron-disagg:role", "?"),
        "router": tags.get("neuron-disagg:router", "no"),
        "instance_type": instance.get("InstanceType", ""),
        "state": instance.get("State", {}).get("Name", "?"),
        "private_ip": instance.get("PrivateIpAddress", "") or "",
        "public_ip": instance.get("PublicIpAddress", "") or "",
        "zone": instance.get("Placement", {}).get("AvailabilityZone", ""),
        "launched": str(instance.get("LaunchTime", "")),
    }
