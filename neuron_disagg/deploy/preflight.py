"""Checks of the subnet, made before launch creates anything, for what would otherwise fail only
after the instances are billing: a zone that does not offer the instance type, and a subnet from
which the instances cannot reach what they read at boot.

Instances with several network interfaces (every EFA type here) get no public IP address, so an
internet gateway alone does not reach them out: the secret (SSM) and the model download need a NAT
gateway (or another default route such as a transit gateway), or VPC endpoints for what is read.
"""

from __future__ import annotations

from typing import Any

from .cloud import Cloud
from .errors import DeployError


class SubnetUnusable(DeployError):
    """The subnet's zone or routes cannot serve this deployment."""

    exit_code = 2


#: A default route through one of these reaches the internet without a public IP on the instance.
_ROUTES_OUT = ("NatGatewayId", "TransitGatewayId", "NetworkInterfaceId", "VpcPeeringConnectionId", "InstanceId")


def check_zone_offers(cloud: Cloud, zone: str, instance_types: list[str]) -> None:
    for instance_type in sorted(set(instance_types)):
        response = cloud.call("ec2", "DescribeInstanceTypeOfferings", LocationType="availability-zone",
                              Filters=[{"Name": "instance-type", "Values": [instance_type]}])
        if response is None:
            continue
        zones = sorted(o["Location"] for o in response.get("InstanceTypeOfferings", []))
        if zone not in zones:
            where = f"it is offered in {', '.join(zones)}: use a subnet there (--subnet)" if zones else \
                "no zone of this region offers it: choose another region"
            raise SubnetUnusable(f"the subnet's Availability Zone {zone} does not offer {instance_type}; {where}")


def _route_table(cloud: Cloud, subnet_id: str, vpc_id: str) -> dict[str, Any] | None:
    for filters in ([{"Name": "association.subnet-id", "Values": [subnet_id]}],
                    [{"Name": "vpc-id", "Values": [vpc_id]}, {"Name": "association.main", "Values": ["true"]}]):
        response = cloud.call("ec2", "DescribeRouteTables", Filters=filters)
        if response is None:
            return None
        if response.get("RouteTables"):
            return response["RouteTables"][0]
    return None


def check_outbound(cloud: Cloud, subnet_id: str, vpc_id: str, reads_ssm: bool) -> None:
    """A default route the instances can use, or else an SSM endpoint (and a note about the model)."""
    table = _route_table(cloud, subnet_id, vpc_id)
    if cloud.dry_run:
        return
    routes = (table or {}).get("Routes", [])
    default = [r for r in routes if r.get("DestinationCidrBlock") == "0.0.0.0/0" and r.get("State", "active") == "active"]
    if any(key in r for r in default for key in _ROUTES_OUT):
        return
    via_igw = any(str(r.get("GatewayId", "")).startswith("igw-") for r in default)
    endpoints = cloud.call("ec2", "DescribeVpcEndpoints", Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])
    services = {e.get("ServiceName", "").rsplit(".", 1)[-1] for e in (endpoints or {}).get("VpcEndpoints", [])}
    why = ("its default route is an internet gateway, but instances with several network interfaces get no public IP"
           if via_igw else "it has no default route")
    if reads_ssm and "ssm" not in services:
        raise SubnetUnusable(
            f"subnet {subnet_id} cannot reach AWS or the internet ({why}): the instances could not read the "
            "deployment secret from SSM nor download the model. Add a NAT gateway route (0.0.0.0/0 -> nat-...) to "
            "its route table, or VPC endpoints for ssm (and the model's source), or use another subnet")
    cloud.note(f"WARNING: subnet {subnet_id} has no route to the internet ({why}); "
               + ("the secret is read through the VPC's SSM endpoint, but " if reads_ssm else "")
               + "the model download from Hugging Face will fail unless the model is on the image or an endpoint")
