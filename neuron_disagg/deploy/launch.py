"""`neuron-disagg launch`: from a deployment config to running P and D instances.

Order matters and is chosen so that a failure costs as little as possible: everything that can
be checked locally (config, secret) is checked before the first AWS call; every read (instance
types, AMI, subnet, reservations) comes before the first write. Instances of one type (and one
reservation) start in one RunInstances call with MinCount = MaxCount: all or none, as a cluster
placement group needs (added one call at a time, a later instance of a new group is the likeliest to
find no capacity). Each instance learns its role from its launch index; the router's host learns
its peers' addresses from tags launch sets once they all exist (user_data.py). If a launch fails
midway, the instances this run started are terminated, whatever stopped it (the placement and
security groups stay for the next try). Instances in a capacity reservation get no placement group
(the reservation fixes where they run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import ami, network, preflight, reservations, secret_parameter, user_data
from .cloud import Cloud, placeholder
from .errors import DeployError, DeploymentExists, ReservationUnusable
from .instance_types import InstanceTypeInfo, describe
from .inventory import find_instances, tag_list
from .settings import DeploymentConfig


@dataclass
class Planned:
    role: str  # "prefill" | "decode"
    index: int
    instance_type: str
    capacity_block_id: str | None
    router: bool = False
    instance_id: str = ""
    private_ip: str = ""

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass
class LaunchGroup:
    """The instances one RunInstances call starts: one type, one reservation or none. The instance
    whose ami-launch-index is k is ``members[k]``."""

    instance_type: str
    capacity_block_id: str | None
    members: list[Planned]


@dataclass
class LaunchResult:
    instances: list[Planned] = field(default_factory=list)
    placement_group: str = ""
    security_group_id: str = ""
    router_url: str = ""
    secret_parameter: str = ""  # the SecureString holding the secret; empty with secret_in_user_data


def plan_launches(deployment: DeploymentConfig) -> list[LaunchGroup]:
    """One launch per instance type and reservation: P and D of one type start together."""
    launches: dict[tuple[str, str | None], LaunchGroup] = {}
    for role, group in (("prefill", deployment.prefill), ("decode", deployment.decode)):
        key = (group.instance_type, group.capacity_block_id)
        members = launches.setdefault(key, LaunchGroup(*key, [])).members
        members += [Planned(role, i, group.instance_type, group.capacity_block_id,
                            router=(role, i) == user_data.router_host(deployment)) for i in range(group.count)]
    return list(launches.values())


def subnet_facts(cloud: Cloud, subnet_id: str) -> tuple[str, str]:
    """(VPC id, Availability Zone) of the subnet."""
    response = cloud.call("ec2", "DescribeSubnets", SubnetIds=[subnet_id])
    if response is None:
        return placeholder(f"VpcId of {subnet_id}"), placeholder(f"AvailabilityZone of {subnet_id}")
    subnet = response["Subnets"][0]
    return subnet["VpcId"], subnet["AvailabilityZone"]


def instance_tags(deployment: DeploymentConfig, instance: Planned) -> dict[str, str]:
    """What status and teardown read: set on each instance once its launch index says which it is."""
    return {"Name": f"{deployment.name}-{instance.name}", "neuron-disagg:role": instance.role,
            "neuron-disagg:index": str(instance.index), "neuron-disagg:router": "yes" if instance.router else "no"}


def run_instances_params(deployment: DeploymentConfig, launch: LaunchGroup, info: InstanceTypeInfo,
                         image: tuple[str, str], placement_group: str, groups: list[str],
                         script: str, reservation: reservations.Reservation | None = None) -> dict[str, Any]:
    """One launch's RunInstances: all its instances or none. Instances in a reservation get no
    placement group: the reservation already fixes where they run, and a placement constraint
    outside it fails with insufficient capacity even while the reservation has room."""
    image_id, root_device = image
    roles = sorted({m.role for m in launch.members})
    tags = {**deployment.resource_tags(), "Name": f"{deployment.name}-{'-'.join(roles)}"}
    count = len(launch.members)
    params: dict[str, Any] = {
        "ImageId": image_id, "InstanceType": launch.instance_type, "MinCount": count, "MaxCount": count,
        "NetworkInterfaces": info.network_interfaces(deployment.subnet_id, groups),
        "BlockDeviceMappings": [{"DeviceName": root_device, "Ebs": {
            "VolumeSize": deployment.root_volume_gib, "VolumeType": "gp3", "DeleteOnTermination": True}}],
        # tags in metadata: the router's host reads its peers from them (no IAM permission needed)
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "InstanceMetadataTags": "enabled"},
        "UserData": script,
        "TagSpecifications": [{"ResourceType": kind, "Tags": tag_list(tags)} for kind in ("instance", "volume")],
    }
    if deployment.key_name:
        params["KeyName"] = deployment.key_name
    if deployment.iam_instance_profile:
        params["IamInstanceProfile"] = {"Name": deployment.iam_instance_profile}
    if reservation is not None:
        params.update(reservation.run_instances_params())
    else:
        params["Placement"] = {"GroupName": placement_group}
    return params


def check_reservations(cloud: Cloud, deployment: DeploymentConfig, zone: str) -> dict[str, reservations.Reservation]:
    """Each reservation named in the config, described and checked against what will launch into it."""
    wanted: dict[str, tuple[str, int]] = {}
    for group in (deployment.prefill, deployment.decode):
        if group.capacity_block_id:
            instance_type, count = wanted.get(group.capacity_block_id, (group.instance_type, 0))
            if instance_type != group.instance_type:
                raise ReservationUnusable(
                    f"prefill and decode name the same reservation {group.capacity_block_id} with different "
                    f"instance types ({instance_type}, {group.instance_type}); a reservation holds one type")
            wanted[group.capacity_block_id] = (instance_type, count + group.count)
    return {rid: reservations.check(cloud, rid, instance_type, zone, count)
            for rid, (instance_type, count) in wanted.items()}


def launch(cloud: Cloud, deployment: DeploymentConfig) -> LaunchResult:
    deployment.require_launchable()
    secret = None
    if not cloud.dry_run:  # a dry run prints the calls without needing (or ever showing) the secret
        secret = deployment.neuron_disagg.load_secret()  # before any AWS call: fail fast, locally
    if deployment.secret_in_user_data:
        cloud.note("WARNING: secret_in_user_data: the deployment secret goes into each instance's user data, "
                   "which anyone allowed ec2:DescribeInstanceAttribute in this account can read. Prefer the "
                   f"default, the SSM SecureString {deployment.secret_parameter} read with iam_instance_profile.")
    running = find_instances(cloud, deployment.name)  # [] in a dry run
    if running:
        raise DeploymentExists(
            f"deployment {deployment.name} already has {len(running)} instance(s) in {cloud.region} "
            f"({', '.join(i['InstanceId'] for i in running)}); see `neuron-disagg status`, remove them with "
            "`neuron-disagg teardown`, or choose another --name")

    types = describe(cloud, [deployment.prefill.instance_type, deployment.decode.instance_type])
    images: dict[str, tuple[str, str]] = {}  # platform -> (image id, root device name)
    for platform in sorted({info.platform for info in types.values()}):
        image_id, source = ami.resolve(cloud, platform, deployment.ami_id, deployment.allow_stock_ami)
        images[platform] = (image_id, ami.root_device(cloud, image_id))
        cloud.note(f"{platform} instances boot {image_id}: {source}")
    vpc_id, zone = subnet_facts(cloud, deployment.subnet_id)
    preflight.check_zone_offers(cloud, zone, [deployment.prefill.instance_type, deployment.decode.instance_type])
    preflight.check_outbound(cloud, deployment.subnet_id, vpc_id, reads_ssm=not deployment.secret_in_user_data)
    reserved = check_reservations(cloud, deployment, zone)
    tags = deployment.resource_tags()
    result = LaunchResult()
    launches = plan_launches(deployment)
    if any(not group.capacity_block_id for group in launches):
        result.placement_group = network.ensure_placement_group(cloud, deployment.name, tags)
    result.security_group_id = network.ensure_security_group(cloud, deployment.name, vpc_id, tags)
    groups = [result.security_group_id, *deployment.extra_security_group_ids]
    if not deployment.secret_in_user_data:
        secret_parameter.store(cloud, deployment.secret_parameter, secret, deployment.name, tags)
        result.secret_parameter = deployment.secret_parameter

    try:
        for group in launches:
            script = user_data.render(deployment, [(m.role, m.index) for m in group.members],  # type: ignore[misc]
                                      secret=secret if deployment.secret_in_user_data else None)
            info = types[group.instance_type]
            params = run_instances_params(deployment, group, info, images[info.platform], result.placement_group,
                                          groups, script, reserved.get(group.capacity_block_id or ""))
            response = cloud.call("ec2", "RunInstances", **params)
            _record_launched(cloud, deployment, group, response, zone)
            result.instances += group.members
        host = next(p for p in result.instances if p.router)
        peers = user_data.peer_tags([(p.role, p.private_ip) for p in result.instances])  # type: ignore[misc]
        cloud.call("ec2", "CreateTags", Resources=[host.instance_id], Tags=tag_list(peers))
    except BaseException as exc:  # a timeout or Ctrl-C too: nothing this run started may keep billing
        started = [p.instance_id for p in result.instances]
        if started and not cloud.dry_run:
            cloud.call("ec2", "TerminateInstances", InstanceIds=started)
            said = (f"terminated the {len(started)} instance(s) this launch had started: {', '.join(started)}; the "
                    "placement and security groups and the secret parameter are kept for the next try, "
                    "`neuron-disagg teardown` removes them")
            if isinstance(exc, DeployError):
                exc.args = (f"{exc}\n({said})",)
            else:
                cloud.note(f"launch stopped by {type(exc).__name__}: {said}")
        raise
    result.router_url = f"http://{host.private_ip}:{deployment.router.port}"
    return result


def _record_launched(cloud: Cloud, deployment: DeploymentConfig, group: LaunchGroup,
                     response: dict[str, Any] | None, zone: str) -> None:
    """Which instance is which member (by launch index; AWS does not promise the list's order), and
    their tags."""
    if response is None:  # a dry run
        for member in group.members:
            member.instance_id = placeholder(f"InstanceId of {member.name}")
            member.private_ip = placeholder(f"private IP of {member.name}")
    else:
        for position, launched in enumerate(response["Instances"]):
            member = group.members[launched.get("AmiLaunchIndex", position)]
            member.instance_id, member.private_ip = launched["InstanceId"], launched.get("PrivateIpAddress", "")
    for member in group.members:
        cloud.call("ec2", "CreateTags", Resources=[member.instance_id],
                   Tags=tag_list(instance_tags(deployment, member)))
        if response is not None:
            cloud.note(f"launched {member.name}: {member.instance_id} {member.instance_type} "
                       f"{member.private_ip} in {zone}" + (" (router)" if member.router else ""))
