"""Checks made before launch creates anything, for what would otherwise fail only after the
security group and the secret exist, or after the instances are billing: a zone that does not offer
the instance type, a subnet from which the instances cannot reach what they read at boot, and limits
EC2 enforces only when RunInstances or CreateTags runs (user data size, tags per resource, a root
volume smaller than the image's snapshot).

Instances with several network interfaces (every EFA type here) get no public IP address, so an
internet gateway alone does not reach them out: the secret (SSM) and the model download need a NAT
gateway (or another default route such as a transit gateway). Without one, only a model already on
the image can serve (and an SSM endpoint must carry the secret). A
VPC peering connection is no way out either: the peer VPC does not forward traffic on to its own
NAT or internet gateway (no transitive routing).
"""

from __future__ import annotations

import re
from typing import Any

from . import user_data
from .cloud import Cloud
from .errors import DeployError, LaunchLimitExceeded
from .settings import DeploymentConfig


class SubnetUnusable(DeployError):
    """The subnet's zone or routes cannot serve this deployment."""

    exit_code = 2


#: A default route through one of these may reach the internet without a public IP on the instance:
#: a NAT gateway or instance, an appliance's interface, a transit gateway or Cloud WAN core network
#: (whose egress lies beyond what this VPC shows). Not a VPC peering connection: a peer VPC does not
#: forward to its NAT or internet gateway.
_ROUTES_OUT = ("NatGatewayId", "InstanceId", "NetworkInterfaceId", "TransitGatewayId", "CoreNetworkArn")
#: GatewayId prefixes that may reach out: a virtual private gateway (to on-premises, which may egress)
#: and a Gateway Load Balancer endpoint (an inspection appliance such as AWS Network Firewall, in
#: front of a NAT gateway). Not ``igw-``: instances without a public IP do not get through it.
_GATEWAYS_OUT = ("vgw-", "vpce-")


def reaches_out(route: dict[str, Any]) -> bool:
    """Whether a (default) route's target can carry an instance without a public IP beyond the VPC."""
    return any(route.get(key) for key in _ROUTES_OUT) or str(route.get("GatewayId", "")).startswith(_GATEWAYS_OUT)


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


def check_outbound(cloud: Cloud, subnet_id: str, vpc_id: str, reads_ssm: bool, model: str = "") -> None:
    """A default route the instances can use. Without one, only a model already on the instances
    (a path) with, where they read SecureStrings, an SSM endpoint: a Hugging Face model downloads
    at every vLLM start, and a host that cannot download it never serves."""
    table = _route_table(cloud, subnet_id, vpc_id)
    if cloud.dry_run:
        return
    routes = (table or {}).get("Routes", [])
    default = [r for r in routes if r.get("DestinationCidrBlock") == "0.0.0.0/0" and r.get("State", "active") == "active"]
    if any(reaches_out(r) for r in default):
        return
    via_igw = any(str(r.get("GatewayId", "")).startswith("igw-") for r in default)
    peering = next((r["VpcPeeringConnectionId"] for r in default if r.get("VpcPeeringConnectionId")), None)
    endpoints = cloud.call("ec2", "DescribeVpcEndpoints", Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])
    services = {e.get("ServiceName", "").rsplit(".", 1)[-1] for e in (endpoints or {}).get("VpcEndpoints", [])}
    if via_igw:
        why = "its default route is an internet gateway, but instances with several network interfaces get no public IP"
    elif peering:
        why = (f"its default route is VPC peering connection {peering}, which reaches only the peer VPC: AWS does "
               "not forward peered traffic on to that VPC's NAT or internet gateway")
    elif default:
        why = "its default route's target does not lead out of the VPC"
    else:
        why = "it has no default route"
    fix = ("Add a NAT gateway route (0.0.0.0/0 -> nat-...) to its route table, or use another subnet (examples/README.md, "
           "step 2)")
    if reads_ssm and "ssm" not in services:
        raise SubnetUnusable(
            f"subnet {subnet_id} cannot reach AWS or the internet ({why}): the instances could not read the "
            f"deployment secret from SSM nor download the model. {fix}, or VPC endpoints for ssm (and a model "
            "already on the image)")
    if not model.startswith("/"):
        raise SubnetUnusable(
            f"subnet {subnet_id} has no route to the internet ({why}): the instances could not download {model} "
            f"from Hugging Face, and hosts that never serve would bill until their serving deadline. {fix}; or "
            "set model to a path the image already holds")
    cloud.note(f"subnet {subnet_id} has no route to the internet ({why}); the model is a path on the image"
               + (" and SecureStrings are read through the VPC's SSM endpoint" if reads_ssm else ""))


# -- limits EC2 checks only when it runs ------------------------------------------------------------------

#: EC2 limits user data to 16 KB of raw data, before base64 encoding.
USER_DATA_MAX_BYTES = 16384
#: EC2 allows at most 50 tags (aws:* excluded, which no one may set) on one resource.
TAGS_PER_RESOURCE_MAX = 50
#: The longest a peer's private IPv4 address can be: the router host's peer tags are counted with it,
#: as the addresses are only known once the instances exist.
WIDEST_IPV4 = "255.255.255.255"


def _lines(pattern: str, script: str) -> list[str]:
    return re.findall(pattern, script, flags=re.MULTILINE)


def check_user_data(script: str, instance_type: str) -> None:
    """Refuses user data over EC2's limit (RunInstances would fail with the placement and security
    groups and the secret created), saying what in it grows: one case line (and one name in the
    header) per instance of the launch, the vLLM arguments once per role, the neuron_disagg config."""
    size = len(script.encode())
    if size <= USER_DATA_MAX_BYTES:
        return
    cases = _lines(r"^ *\d+\) ROLE=.*$", script)
    names = _lines(r"^# neuron-disagg .* of deployment .*$", script)[:1]
    args = _lines(r"^ *printf 'VLLM_ARGS=.*$", script)
    config = re.search(r"config\.yaml\" <<'(\w+)'\n(.*?)^\1$", script, flags=re.MULTILINE | re.DOTALL)
    parts = []
    if cases:
        parts.append(f"{sum(len(line) + 1 for line in cases + names):,} bytes for its {len(cases)} instances "
                     "(a line each says which instance it is)")
    if args:
        parts.append(f"{sum(len(line) + 1 for line in args):,} bytes of vLLM arguments (written once per role: "
                     f"{len(args)})")
    if config:
        parts.append(f"{len(config.group(2).encode()):,} bytes of the neuron_disagg config")
    raise LaunchLimitExceeded(
        f"the user data of the {instance_type} launch would be {size:,} bytes; EC2 allows {USER_DATA_MAX_BYTES:,} "
        f"(16 KB, before base64 encoding) and RunInstances would fail. Of it: {'; '.join(parts) or 'see the script'}"
        ". Shorten vllm_args, start fewer instances in one "
        "launch (prefill and decode of one instance type and capacity reservation start together: lower "
        "prefill.count/decode.count, or split them across types or reservations), or set fewer neuron_disagg "
        "settings (defaults are left out)")


def check_tag_count(deployment: DeploymentConfig, own_tags: dict[str, dict[str, str]], router: str) -> None:
    """Refuses a launch whose instances would carry more than EC2's 50 tags: the deployment's tags
    (``resource_tags``) plus launch's own per instance (``own_tags``: instance name -> tags), plus on
    the router's host (``router``, an instance name) the peer tags naming every instance's address
    (counted with the widest addresses). CreateTags would fail only once the instances run."""
    config_tags = deployment.resource_tags()
    roles = ["prefill"] * deployment.prefill.count + ["decode"] * deployment.decode.count
    peers = user_data.peer_tags([(role, WIDEST_IPV4) for role in roles])  # type: ignore[misc]
    for name, own in own_tags.items():
        tags = {**config_tags, **own, **(peers if name == router else {})}
        if len(tags) <= TAGS_PER_RESOURCE_MAX:
            continue
        launch_own = len(tags) - len(deployment.tags)
        peer_part = f", {len(peers)} of them naming the {len(roles)} instances' addresses" if name == router else ""
        raise LaunchLimitExceeded(
            f"instance {name} would carry {len(tags)} tags; EC2 allows {TAGS_PER_RESOURCE_MAX} per resource. "
            f"{len(deployment.tags)} come from `tags` in the deployment config, {launch_own} are launch's own "
            f"(neuron-disagg:*, Name{peer_part}). Remove at least {len(tags) - TAGS_PER_RESOURCE_MAX} from `tags`"
            + (" (or launch fewer instances: the router's host is tagged with every address)" if peer_part else ""))


def check_root_volume(root_volume_gib: int, image_id: str, snapshot_gib: int | None) -> None:
    """Refuses a root volume smaller than the image's root snapshot (``ami.root_volume``), which
    RunInstances refuses only after the security group and the secret exist. Unknown size: no check."""
    if snapshot_gib is not None and root_volume_gib < snapshot_gib:
        raise LaunchLimitExceeded(
            f"root_volume_gib is {root_volume_gib} GiB, smaller than the {snapshot_gib} GiB root snapshot of AMI "
            f"{image_id}; RunInstances would refuse it. Set root_volume_gib to at least {snapshot_gib} (the "
            "model's weights and the compile cache need room beyond the image too)")
