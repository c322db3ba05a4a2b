"""`neuron-disagg launch`: from a deployment config to running P and D instances.

Order matters and is chosen so that a failure costs as little as possible: everything that can
be checked locally (config, secret) is checked before the first AWS call; every read (instance
types, AMI, subnet, reservations, the account's vCPU quotas, a Hugging Face token's SecureString)
comes before the first write. Instances of one type (and one
reservation) start in one RunInstances call with MinCount = MaxCount: all or none, as a cluster
placement group needs (added one call at a time, a later instance of a new group is the likeliest to
find no capacity). Each instance learns its role from its launch index; the router's host learns
its peers' addresses from tags launch sets once they all exist (user_data.py). If a launch fails
midway, every instance carrying the deployment's tag is terminated, whatever stopped it (the
placement and security groups stay for the next try); the instances are recorded the moment
RunInstances answers, before anything else (tagging) can fail. An instance whose boot fails, or
that does not serve within its deadline, or that has run max_hours, shuts itself down (user_data.py,
ami/boot/guard.sh), and launch makes that a termination (``InstanceInitiatedShutdownBehavior``).
Instances in a capacity reservation get no placement group of ours (the reservation fixes where
they run); one made inside a cluster placement group is launched into that group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from . import (ami, cost, instance_profile, network, preflight, quotas, reservations, secret_parameter, sizing,
               user_data)
from .cloud import Cloud, placeholder
from .errors import AwsCallFailed, DeployError, DeploymentExists, ReservationUnusable
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
    placement group of ours: the reservation already fixes where they run, and a placement
    constraint outside it fails with insufficient capacity even while the reservation has room. A
    reservation made in a cluster placement group names that group (Reservation.placement_group)."""
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
        # A boot that fails shuts its host down (user_data.py); terminate, so that it stops billing.
        "InstanceInitiatedShutdownBehavior": "terminate",
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


def check_reservations(cloud: Cloud, deployment: DeploymentConfig, zone: str,
                       types: dict[str, InstanceTypeInfo]) -> dict[str, reservations.Reservation]:
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
    return {rid: reservations.check(cloud, rid, instance_type, zone, count, platform=types[instance_type].platform)
            for rid, (instance_type, count) in wanted.items()}


def launch(cloud: Cloud, deployment: DeploymentConfig,
           confirm: Callable[[str], None] | None = None) -> LaunchResult:
    """``confirm`` gets what the launch will cost once every check has passed and before the first
    write; it raises to stop (the CLI asks, or needs --yes). A dry run only prints that summary."""
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

    instance_profile.check(cloud, deployment)  # one that cannot read the secret boots instances that power off
    types = describe(cloud, [deployment.prefill.instance_type, deployment.decode.instance_type])
    hosts = sizing.plans(deployment, types)
    for role, host in hosts.items():
        cloud.note(f"{role}: {host.describe()}")
        if host.idle and not cloud.dry_run:
            cloud.note(f"WARNING: {host.idle} accelerator(s) of each {role} host stay idle: set hosts.{host.platform}"
                       ".tensor_parallel_size and instances_per_host so that they fill it")
    images: dict[str, tuple[str, str]] = {}  # platform -> (image id, root device name)
    for platform in sorted({info.platform for info in types.values()}):
        image_id, source = ami.resolve(cloud, platform, deployment.ami_id, deployment.allow_stock_ami)
        root_device, snapshot_gib = ami.root_volume(cloud, image_id)
        preflight.check_root_volume(deployment.root_volume_gib, image_id, snapshot_gib)
        images[platform] = (image_id, root_device)
        cloud.note(f"{platform} instances boot {image_id}: {source}")
    vpc_id, zone = subnet_facts(cloud, deployment.subnet_id)
    preflight.check_zone_offers(cloud, zone, [deployment.prefill.instance_type, deployment.decode.instance_type])
    preflight.check_outbound(cloud, deployment.subnet_id, vpc_id, reads_ssm=bool(deployment.parameters_read_at_boot),
                             model=deployment.model)
    if deployment.hf_token_ssm_parameter:
        secret_parameter.check_exists(cloud, deployment.hf_token_ssm_parameter, "the Hugging Face token")
    reserved = check_reservations(cloud, deployment, zone, types)
    tags = deployment.resource_tags()
    result = LaunchResult()
    launches = plan_launches(deployment)
    scripts = [user_data.render(deployment, [(m.role, m.index) for m in group.members],  # type: ignore[misc]
                                secret=secret if deployment.secret_in_user_data else None, hosts=hosts,
                                deadline_s=sizing.serving_deadline_s(deployment, types[group.instance_type].platform
                                                                     or "cuda"))
               for group in launches]
    for group, script in zip(launches, scripts, strict=True):
        preflight.check_user_data(script, group.instance_type)
    members = [m for group in launches for m in group.members]
    preflight.check_tag_count(deployment, {m.name: instance_tags(deployment, m) for m in members},
                              router=next(m.name for m in members if m.router))
    quotas.check(cloud, [(group.instance_type, len(group.members), bool(group.capacity_block_id))
                         for group in launches], types)
    bill = cost.summary(deployment.name, cloud.region, cost.estimate(cloud, cloud.region, [
        (group.instance_type, len(group.members),
         bool(group.capacity_block_id) and reserved[group.capacity_block_id].capacity_block) for group in launches]),
        deployment.max_hours)
    if cloud.dry_run or confirm is None:
        cloud.note(bill)
    else:
        confirm(bill)  # the last moment nothing exists yet
    if any(not group.capacity_block_id for group in launches):
        result.placement_group = network.ensure_placement_group(cloud, deployment.name, tags)
    result.security_group_id = network.ensure_security_group(cloud, deployment.name, vpc_id, tags)
    groups = [result.security_group_id, *deployment.extra_security_group_ids]
    if not deployment.secret_in_user_data:
        secret_parameter.store(cloud, deployment.secret_parameter, secret, deployment.name, tags)
        result.secret_parameter = deployment.secret_parameter

    try:
        for group, script in zip(launches, scripts, strict=True):
            info = types[group.instance_type]
            params = run_instances_params(deployment, group, info, images[info.platform], result.placement_group,
                                          groups, script, reserved.get(group.capacity_block_id or ""))
            response = cloud.call("ec2", "RunInstances", **params)
            _identify(group, response)
            result.instances += group.members  # recorded before anything else can fail: cleanup needs them
            _tag_launched(cloud, deployment, group, zone, announce=response is not None)
        host = next(p for p in result.instances if p.router)
        peers = user_data.peer_tags([(p.role, p.private_ip) for p in result.instances])  # type: ignore[misc]
        tag_new_instances(cloud, [host.instance_id], peers)
    except BaseException as exc:  # a timeout or Ctrl-C too: nothing this run started may keep billing
        if not cloud.dry_run:
            said = _terminate_after_failure(cloud, deployment, [p.instance_id for p in result.instances])
            if said and isinstance(exc, DeployError):
                exc.args = (f"{exc}\n({said})",)
            elif said:
                cloud.note(f"launch stopped by {type(exc).__name__}: {said}")
        raise
    result.router_url = f"http://{host.private_ip}:{deployment.router.port}"
    return result


def _identify(group: LaunchGroup, response: dict[str, Any] | None) -> None:
    """Which instance is which member: by launch index, as AWS does not promise the list's order."""
    if response is None:  # a dry run
        for member in group.members:
            member.instance_id = placeholder(f"InstanceId of {member.name}")
            member.private_ip = placeholder(f"private IP of {member.name}")
        return
    for position, launched in enumerate(response["Instances"]):
        member = group.members[launched.get("AmiLaunchIndex", position)]
        member.instance_id, member.private_ip = launched["InstanceId"], launched.get("PrivateIpAddress", "")


def _tag_launched(cloud: Cloud, deployment: DeploymentConfig, group: LaunchGroup, zone: str,
                  announce: bool) -> None:
    for member in group.members:
        tag_new_instances(cloud, [member.instance_id], instance_tags(deployment, member))
        if announce:
            cloud.note(f"launched {member.name}: {member.instance_id} {member.instance_type} "
                       f"{member.private_ip} in {zone}" + (" (router)" if member.router else ""))


def tag_new_instances(cloud: Cloud, instance_ids: list[str], tags: dict[str, str]) -> None:
    """CreateTags on instances RunInstances has just returned. EC2 is eventually consistent: a call
    naming them may fail with InvalidInstanceID.NotFound for a few seconds, and botocore's retries
    do not cover that code, so it is retried here, a bounded number of times."""
    for delay_s in (*TAG_RETRY_DELAYS_S, None):
        try:
            cloud.call("ec2", "CreateTags", Resources=instance_ids, Tags=tag_list(tags))
            return
        except AwsCallFailed as exc:
            if exc.code != "InvalidInstanceID.NotFound" or delay_s is None:
                raise
        cloud.wait(delay_s)


#: Between tries of CreateTags on a new instance: about a minute in all (AWS advises exponential backoff).
TAG_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


def _terminate_after_failure(cloud: Cloud, deployment: DeploymentConfig, started: list[str]) -> str:
    """Terminates what this launch started: the instances it recorded and any other carrying the
    deployment's tag (RunInstances tags them as it creates them, so even an instance whose answer
    never came is found). Returns what to tell the user; never raises, because the error that
    stopped the launch must still reach them, with the ids of whatever may still run."""
    ids = set(filter(None, started))
    try:
        ids |= {i["InstanceId"] for i in find_instances(cloud, deployment.name)}
    except Exception as exc:  # noqa: BLE001 - the recorded ids are still terminated below
        cloud.note(f"could not list the deployment's instances to clean up ({exc})")
    if not ids:
        return ""
    listed = ", ".join(sorted(ids))
    try:
        cloud.call("ec2", "TerminateInstances", InstanceIds=sorted(ids))
    except Exception as exc:  # noqa: BLE001
        return (f"TERMINATING THE {len(ids)} INSTANCE(S) THIS LAUNCH STARTED FAILED ({exc}); they may still run "
                f"and bill: {listed}. Run `neuron-disagg teardown` with the same config and --name "
                f"{deployment.name}, or terminate them in the EC2 console")
    return (f"terminated the {len(ids)} instance(s) this launch had started: {listed}; the "
            "placement and security groups and the secret parameter are kept for the next try, "
            "`neuron-disagg teardown` removes them")
