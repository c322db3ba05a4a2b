"""The deployment's cluster placement group and security group: found by name and reused, or
created and tagged so that teardown knows it may delete them.

Why these two: a cluster placement group puts P and D on the same network spine (lowest EFA
latency); EFA traffic needs a security group that allows all traffic to and from itself.
"""

from __future__ import annotations

from typing import Any

from .cloud import Cloud, placeholder
from .errors import AwsCallFailed

CREATED_BY_TAG = "neuron-disagg:created-by"


def resource_name(deployment: str) -> str:
    return f"neuron-disagg-{deployment}"


def _tag_spec(resource_type: str, tags: dict[str, str]) -> list[dict[str, Any]]:
    merged = {**tags, CREATED_BY_TAG: "launch"}
    return [{"ResourceType": resource_type, "Tags": [{"Key": k, "Value": v} for k, v in sorted(merged.items())]}]


# -- placement group ---------------------------------------------------------------------------------
def find_placement_group(cloud: Cloud, name: str) -> dict[str, Any] | None:
    try:
        response = cloud.call("ec2", "DescribePlacementGroups", Filters=[{"Name": "group-name", "Values": [name]}])
    except AwsCallFailed as exc:
        if exc.code == "InvalidPlacementGroup.Unknown":
            return None
        raise
    if response is None:
        return None
    groups = [g for g in response.get("PlacementGroups", []) if g.get("State") not in ("deleting", "deleted")]
    return groups[0] if groups else None


def ensure_placement_group(cloud: Cloud, deployment: str, tags: dict[str, str]) -> str:
    name = resource_name(deployment)
    existing = find_placement_group(cloud, name)
    if existing is not None:
        if existing.get("Strategy") != "cluster":
            raise AwsCallFailed("CreatePlacementGroup", "PlacementGroupStrategy",
                                f"placement group {name} exists with strategy {existing.get('Strategy')}, not "
                                "cluster; delete it or choose another deployment name")
        cloud.note(f"reusing placement group {name}")
        return name
    cloud.call("ec2", "CreatePlacementGroup", GroupName=name, Strategy="cluster",
               TagSpecifications=_tag_spec("placement-group", tags))
    if not cloud.dry_run:
        cloud.note(f"created placement group {name} (cluster)")
    return name


def delete_placement_group(cloud: Cloud, deployment: str) -> bool:
    name = resource_name(deployment)
    group = find_placement_group(cloud, name)
    if cloud.dry_run:
        cloud.call("ec2", "DeletePlacementGroup", GroupName=name)
        return True
    if group is None:
        return False
    if not _ours(group.get("Tags", []), deployment):
        cloud.note(f"leaving placement group {name}: it was not created by launch of {deployment}")
        return False
    try:
        cloud.call("ec2", "DeletePlacementGroup", GroupName=name)
    except AwsCallFailed as exc:
        if exc.code == "InvalidPlacementGroup.Unknown":
            return False
        raise
    return True


# -- security group ----------------------------------------------------------------------------------
def find_security_groups(cloud: Cloud, name: str, vpc_id: str | None = None,
                         deployment: str | None = None) -> list[dict[str, Any]]:
    """Every group of that name (in ``vpc_id``, tagged with ``deployment``, where given). A group name is
    unique per VPC only: a deployment relaunched into another VPC's subnet has one in each."""
    filters = [{"Name": "group-name", "Values": [name]}]
    if vpc_id:
        filters.append({"Name": "vpc-id", "Values": [vpc_id]})
    if deployment:
        filters.append({"Name": "tag:neuron-disagg:deployment", "Values": [deployment]})
    groups: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        response = cloud.call("ec2", "DescribeSecurityGroups", Filters=filters, **({"NextToken": token} if token else {}))
        if response is None:
            return groups
        groups += response.get("SecurityGroups", [])
        token = response.get("NextToken")
        if not token:
            return groups


def find_security_group(cloud: Cloud, name: str, vpc_id: str | None = None,
                        deployment: str | None = None) -> dict[str, Any] | None:
    groups = find_security_groups(cloud, name, vpc_id, deployment)
    return groups[0] if groups else None


def _allows_self(group: dict[str, Any], key: str) -> bool:
    return any(rule.get("IpProtocol") == "-1" and any(pair.get("GroupId") == group["GroupId"]
                                                      for pair in rule.get("UserIdGroupPairs", []))
               for rule in group.get(key, []))


def ensure_security_group(cloud: Cloud, deployment: str, vpc_id: str, tags: dict[str, str]) -> str:
    """A group allowing all traffic from and to itself (EFA needs both directions), nothing else in."""
    name = resource_name(deployment)
    group = find_security_group(cloud, name, vpc_id)
    if group is None:
        response = cloud.call("ec2", "CreateSecurityGroup", GroupName=name, VpcId=vpc_id,
                              Description=f"neuron-disagg {deployment}: all traffic between its instances (EFA)",
                              TagSpecifications=_tag_spec("security-group", tags))
        group_id = placeholder(f"GroupId of {name}") if response is None else response["GroupId"]
        group = {"GroupId": group_id}
        if not cloud.dry_run:
            cloud.note(f"created security group {name} ({group_id})")
    else:
        cloud.note(f"reusing security group {name} ({group['GroupId']})")
    rule = [{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group["GroupId"],
                                                       "Description": "EFA and serving traffic within the deployment"}]}]
    if not _allows_self(group, "IpPermissions"):
        cloud.call("ec2", "AuthorizeSecurityGroupIngress", GroupId=group["GroupId"], IpPermissions=rule)
    if not _allows_self(group, "IpPermissionsEgress"):
        cloud.call("ec2", "AuthorizeSecurityGroupEgress", GroupId=group["GroupId"], IpPermissions=rule)
    return group["GroupId"]


def delete_security_groups(cloud: Cloud, deployment: str, timeout_s: float, poll_s: float) -> list[str]:
    """Delete every group of ours with the deployment's name (one per VPC it was launched into),
    retrying while terminated instances' interfaces still hold one. Returns the ids deleted."""
    name = resource_name(deployment)
    groups = find_security_groups(cloud, name, deployment=deployment)
    if cloud.dry_run:
        cloud.call("ec2", "DeleteSecurityGroup", GroupId=placeholder(f"GroupId of each {name}"))
        return [placeholder(f"GroupId of each {name}")]
    deleted = []
    for group in groups:
        if not _ours(group.get("Tags", []), deployment):
            cloud.note(f"leaving security group {name} ({group['GroupId']}): it was not created by launch of "
                       f"{deployment}")
            continue
        if _delete_security_group(cloud, group["GroupId"], timeout_s, poll_s):
            deleted.append(group["GroupId"])
    return deleted


def _delete_security_group(cloud: Cloud, group_id: str, timeout_s: float, poll_s: float) -> bool:
    waited = 0.0
    while True:
        try:
            cloud.call("ec2", "DeleteSecurityGroup", GroupId=group_id)
            return True
        except AwsCallFailed as exc:
            if exc.code == "InvalidGroup.NotFound":
                return False
            if exc.code != "DependencyViolation" or waited >= timeout_s:
                raise
        cloud.wait(poll_s)
        waited += poll_s


def _ours(tags: list[dict[str, str]], deployment: str) -> bool:
    values = {tag["Key"]: tag["Value"] for tag in tags}
    return values.get("neuron-disagg:deployment") == deployment and values.get(CREATED_BY_TAG) == "launch"
