"""launch / status / teardown against moto running as a server process (boto3 over HTTP).

moto keeps the instances, security groups, images, subnets and tags; placement groups and the
EFA interface types are what it lacks (see conftest.py): the interface layout is read from the
RunInstances request as it went over the wire, because moto stores every interface as a plain
`interface` on card 0.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from neuron_disagg.config import ConfigError
from neuron_disagg.deploy import ami
from neuron_disagg.deploy.cloud import Cloud
from botocore.exceptions import ReadTimeoutError

from neuron_disagg.deploy.errors import (DeploymentExists, MissingCredentials, NoCapacity, ReservationUnusable,
                                         UnsupportedInstanceType)
from neuron_disagg.deploy.launch import launch
from neuron_disagg.deploy.preflight import SubnetUnusable
from neuron_disagg.deploy.settings import DeploymentConfig
from neuron_disagg.deploy.status import status
from neuron_disagg.deploy.teardown import teardown

from .conftest import INSTANCE_PROFILE, REGION, SECRET, register_image, subnet_in, write_config
from .test_user_data import env_file, run_script


def deployment(tmp_path, network, **values) -> DeploymentConfig:
    return DeploymentConfig.from_yaml(write_config(tmp_path, network, **values))


def interfaces(wire: dict[str, str]) -> list[dict[str, str]]:
    """NetworkInterface.N.Field=value pairs of a RunInstances body -> one dict per interface."""
    found: dict[int, dict[str, str]] = {}
    for key, value in wire.items():
        if key.startswith("NetworkInterface."):
            _, index, field = key.split(".", 2)
            found.setdefault(int(index), {})[field] = value
    return [found[i] for i in sorted(found)]


def instances_of(ec2, name: str = "t1") -> list[dict[str, Any]]:
    pages = ec2.describe_instances(Filters=[{"Name": "tag:neuron-disagg:deployment", "Values": [name]},
                                            {"Name": "instance-state-name", "Values": ["pending", "running"]}])
    return [i for r in pages["Reservations"] for i in r["Instances"]]


def tags(resource: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def user_data(ec2, instance_id: str) -> str:
    value = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")["UserData"]["Value"]
    return base64.b64decode(value).decode()


def test_launch_creates_placement_group_security_group_and_instances(cloud, network, baked_ami, gaps, ec2, tmp_path):
    result = launch(cloud, deployment(tmp_path, network))

    group = gaps.placement_groups["neuron-disagg-t1"]
    assert group["Strategy"] == "cluster"
    assert tags(group) == {"neuron-disagg:deployment": "t1", "neuron-disagg:created-by": "launch"}

    sg = ec2.describe_security_groups(GroupIds=[result.security_group_id])["SecurityGroups"][0]
    assert sg["VpcId"] == network["vpc_id"] and tags(sg)["neuron-disagg:created-by"] == "launch"
    for direction in ("IpPermissions", "IpPermissionsEgress"):  # all traffic from and to itself
        assert any(rule["IpProtocol"] == "-1" and [p["GroupId"] for p in rule["UserIdGroupPairs"]] == [sg["GroupId"]]
                   for rule in sg[direction]), direction
    assert not any(rule.get("IpRanges") for rule in sg["IpPermissions"])  # nothing else may come in

    launched = {tags(i)["neuron-disagg:role"]: i for i in instances_of(ec2)}
    assert set(launched) == {"prefill", "decode"}
    for role, instance in launched.items():
        assert instance["ImageId"] == baked_ami and instance["InstanceType"] == "trn2.48xlarge"
        assert instance["KeyName"] == "my-key" and instance["SubnetId"] == network["subnet_id"]
        primary = next(n for n in instance["NetworkInterfaces"] if n["Attachment"]["DeviceIndex"] == 0)
        assert [g["GroupId"] for g in primary["Groups"]] == [result.security_group_id]
        assert tags(instance)["Name"] == f"t1-{role}-0"
    assert tags(launched["prefill"])["neuron-disagg:router"] == "yes"
    assert [p.name for p in result.instances] == ["prefill-0", "decode-0"]
    assert result.router_url == f"http://{launched['prefill']['PrivateIpAddress']}:8000"

    (wire,) = gaps.run_instances_wire  # P and D of one type: one call, both or neither
    assert wire["MinCount"] == wire["MaxCount"] == "2"
    assert wire["Placement.GroupName"] == "neuron-disagg-t1"
    assert wire["MetadataOptions.HttpTokens"] == "required"
    assert wire["MetadataOptions.InstanceMetadataTags"] == "enabled"  # the router's host reads its peers there
    assert wire["IamInstanceProfile.Name"] == INSTANCE_PROFILE  # what reads the secret

    script = user_data(ec2, launched["decode"]["InstanceId"])
    assert script == user_data(ec2, launched["prefill"]["InstanceId"])  # one script: the launch index decides
    assert "0) ROLE=prefill; INDEX=0 ;;" in script and "1) ROLE=decode; INDEX=0 ;;" in script
    # the secret comes from SSM, not from the user data
    assert "aws ssm get-parameter --region us-east-2 --with-decryption --name \"$1\"" in script
    assert 'fetch_secure_string /neuron-disagg/t1/secret "$ETC/secret"' in script
    assert SECRET not in script and base64.b64encode(SECRET.encode()).decode() not in script
    ips = {role: i["PrivateIpAddress"] for role, i in launched.items()}
    assert tags(launched["prefill"])["neuron-disagg:peers-count"] == "2"
    assert tags(launched["prefill"])["neuron-disagg:peers-0"] == f"prefill@{ips['prefill']} decode@{ips['decode']}"
    assert not any(k.startswith("neuron-disagg:peers") for k in tags(launched["decode"]))


@pytest.mark.parametrize("instance_type, cards", [("trn2.48xlarge", 16), ("p5en.48xlarge", 16), ("trn1.32xlarge", 8)])
def test_one_efa_interface_per_network_card(cloud, network, baked_ami, gaps, ec2, tmp_path, instance_type, cards):
    register_image(ec2, "neuron-disagg-cuda-test", "cuda")
    info = ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"][0]["NetworkInfo"]
    assert info["MaximumNetworkCards"] == cards  # the layout below comes from this, not from a table

    subnet = subnet_in(ec2, network, f"{REGION}c" if instance_type == "trn1.32xlarge" else network["zone"])
    result = launch(cloud, deployment(tmp_path, network, prefill={"instance_type": instance_type},
                                      decode={"instance_type": instance_type}, subnet_id=subnet))

    wire = [w for w in gaps.run_instances_wire if w.get("InstanceType") == instance_type]
    assert len(wire) == 1
    for body in wire:
        layout = interfaces(body)
        assert [int(i["NetworkCardIndex"]) for i in layout] == list(range(cards))
        assert layout[0]["InterfaceType"] == "efa"
        assert {i["InterfaceType"] for i in layout[1:]} == {"efa-only"}
        assert {i["DeviceIndex"] for i in layout} == {"0"}
        assert all(i["SubnetId"] == subnet and i["SecurityGroupId.1"] == result.security_group_id
                   and i["DeleteOnTermination"] == "true" for i in layout)
        assert "SubnetId" not in body and "SecurityGroupId.1" not in body  # only on the interfaces


def test_second_launch_reuses_placement_and_security_group(cloud, network, baked_ami, gaps, ec2, tmp_path):
    first = launch(cloud, deployment(tmp_path, network))
    ec2.terminate_instances(InstanceIds=[p.instance_id for p in first.instances])

    second = launch(cloud, deployment(tmp_path, network))

    assert second.security_group_id == first.security_group_id
    assert list(gaps.placement_groups) == ["neuron-disagg-t1"]
    named = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["neuron-disagg-t1"]}])
    assert len(named["SecurityGroups"]) == 1
    log = cloud.log.getvalue()
    assert "reusing placement group neuron-disagg-t1" in log and "reusing security group" in log
    assert len(instances_of(ec2)) == 2


def test_launch_refuses_to_double_a_running_deployment(cloud, network, baked_ami, ec2, tmp_path):
    launch(cloud, deployment(tmp_path, network))
    with pytest.raises(DeploymentExists, match="teardown"):
        launch(cloud, deployment(tmp_path, network))
    assert len(instances_of(ec2)) == 2


def test_xpyd_launches_each_type_in_one_call_and_the_router_host_learns_every_address(
        cloud, network, baked_ami, gaps, ec2, tmp_path):
    """2P3D of two types: one RunInstances per type; each instance learns its role from its launch
    index; the router's host boots (its user data run here, with launch's tags as its metadata)
    and lists every instance by the address EC2 gave it."""
    register_image(ec2, "neuron-disagg-cuda-test", "cuda")
    result = launch(cloud, deployment(tmp_path, network, prefill={"instance_type": "trn2.48xlarge", "count": 2},
                                      decode={"instance_type": "p5en.48xlarge", "count": 3},
                                      router={"host": "decode"}))
    assert [(w["InstanceType"], w["MinCount"], w["MaxCount"]) for w in gaps.run_instances_wire] == [
        ("trn2.48xlarge", "2", "2"), ("p5en.48xlarge", "3", "3")]
    by_id = {i["InstanceId"]: i for i in instances_of(ec2)}
    assert len(by_id) == 5
    for planned in result.instances:
        assert tags(by_id[planned.instance_id])["Name"] == f"t1-{planned.name}"
        assert by_id[planned.instance_id]["PrivateIpAddress"] == planned.private_ip
    router = next(p for p in result.instances if p.router)
    assert router.name == "decode-0"
    launch_index = [p.name for p in result.instances if p.role == "decode"].index("decode-0")
    done, root = run_script(user_data(ec2, router.instance_id), tmp_path, launch_index=launch_index,
                            instance_tags=tags(by_id[router.instance_id]), host_ip=router.private_ip)
    assert done.returncode == 0, done.stdout + done.stderr
    args = env_file(root / "etc/neuron-disagg/router.env")["ROUTER_ARGS"]
    for planned in result.instances:  # each host's every instance: 8 on a trn2.48xlarge, 1 on a p5en.48xlarge
        flag, port, count = ("--prefill", 8100, 8) if planned.role == "prefill" else ("--decode", 8200, 1)
        for k in range(count):
            ip = planned.private_ip
            assert f"{flag} http://{ip}:{port + k},side_channel={ip}:{5600 + 8 * k},tp=8" in args
        assert f"{flag} http://{planned.private_ip}:{port + count}," not in args
    assert "enable --now neuron-disagg-router.service" in (root / "systemctl.log").read_text()


def test_status_lists_the_deployment_by_tag(cloud, network, baked_ami, ec2, tmp_path):
    launch(cloud, deployment(tmp_path, network))
    launch(cloud, deployment(tmp_path, network, name="other"))

    rows = status(cloud, "t1")

    assert [r["name"] for r in rows] == ["t1-decode-0", "t1-prefill-0"]
    assert all(r["state"] in ("pending", "running") and r["private_ip"].startswith("10.20.1.") for r in rows)
    assert [r["router"] for r in rows] == ["no", "yes"]
    assert status(cloud, "nothing-here") == []


def test_teardown_removes_everything_launch_created_and_is_idempotent(cloud, network, baked_ami, gaps, ec2,
                                                                      tmp_path):
    launched = launch(cloud, deployment(tmp_path, network))
    other = launch(cloud, deployment(tmp_path, network, name="other"))

    result = teardown(cloud, "t1", secret_parameter_name="/neuron-disagg/t1/secret", timeout_s=30, poll_s=0.1)

    assert result.secret_parameter_deleted == "/neuron-disagg/t1/secret"
    assert sorted(result.terminated) == sorted(p.instance_id for p in launched.instances)
    assert result.security_group_deleted and result.placement_group_deleted
    assert instances_of(ec2) == [] and len(instances_of(ec2, "other")) == 2  # only this deployment
    assert not ec2.describe_security_groups(
        Filters=[{"Name": "group-id", "Values": [launched.security_group_id]}])["SecurityGroups"]
    assert list(gaps.placement_groups) == ["neuron-disagg-other"]
    assert other.security_group_id != launched.security_group_id

    again = teardown(cloud, "t1", secret_parameter_name="/neuron-disagg/t1/secret", timeout_s=30, poll_s=0.1)
    assert not again.anything  # the parameter already gone is no error either
    assert not teardown(cloud, "never-launched", timeout_s=30, poll_s=0.1).anything


def test_teardown_leaves_groups_launch_did_not_create(cloud, network, gaps, ec2):
    sg = ec2.create_security_group(GroupName="neuron-disagg-mine", Description="made by hand",
                                   VpcId=network["vpc_id"],
                                   TagSpecifications=[{"ResourceType": "security-group", "Tags": [
                                       {"Key": "neuron-disagg:deployment", "Value": "mine"}]}])["GroupId"]
    result = teardown(cloud, "mine", timeout_s=30, poll_s=0.1)
    assert not result.security_group_deleted
    assert ec2.describe_security_groups(GroupIds=[sg])["SecurityGroups"]


def test_missing_credentials_is_a_clear_error(aws_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(MissingCredentials, match="aws configure"):
        Cloud.connect(REGION)


@pytest.mark.parametrize("instance_type, reason", [("m5.large", "has no EFA"), ("g6.xlarge", "has no EFA"),
                                                   ("nope.48xlarge", "not an instance type")])
def test_unsupported_instance_type_fails_before_anything_is_created(cloud, network, gaps, ec2, tmp_path,
                                                                   instance_type, reason):
    with pytest.raises(UnsupportedInstanceType, match=reason):
        launch(cloud, deployment(tmp_path, network, decode={"instance_type": instance_type}))
    assert gaps.placement_groups == {} and gaps.run_instances_wire == []
    assert not ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["neuron-disagg-t1"]}])[
        "SecurityGroups"]


def test_no_capacity_names_the_ways_out_and_rolls_back(cloud, network, baked_ami, gaps, ec2, tmp_path):
    gaps.fail_run_instances = ("InsufficientInstanceCapacity",
                               "We currently do not have sufficient p5en.48xlarge capacity in the zone you requested.")
    gaps.fail_after = len(gaps.run_instances_wire) + 1  # P's type starts, then D's finds no capacity
    register_image(ec2, "neuron-disagg-cuda-test", "cuda")

    with pytest.raises(NoCapacity) as err:
        launch(cloud, deployment(tmp_path, network, decode={"instance_type": "p5en.48xlarge"}))

    message = str(err.value)
    assert "Capacity Block" in message and "another Availability Zone" in message and "p5en.48xlarge" in message
    assert "terminated the 1 instance(s)" in message
    assert instances_of(ec2) == []
    assert "neuron-disagg-t1" in gaps.placement_groups  # kept for the next try


def test_capacity_block_is_requested_for_every_instance_without_a_placement_group(cloud, network, baked_ami, gaps,
                                                                                  tmp_path):
    gaps.reserve("cr-0abc", "trn2.48xlarge", network["zone"])
    launch(cloud, deployment(tmp_path, network, prefill={"instance_type": "trn2.48xlarge", "capacity_block_id": "cr-0abc"},
                             decode={"instance_type": "trn2.48xlarge", "capacity_block_id": "cr-0abc"}))
    wire = [w for w in gaps.run_instances_wire if w.get("InstanceType") == "trn2.48xlarge"]
    assert len(wire) == 1 and wire[0]["MinCount"] == "2"
    for body in wire:
        assert body["InstanceMarketOptions.MarketType"] == "capacity-block"
        assert body["CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId"] == "cr-0abc"
        assert not any(key.startswith("Placement.") for key in body), body  # the block fixes placement
    assert gaps.placement_groups == {}


def test_an_on_demand_capacity_reservation_launches_as_one(cloud, network, baked_ami, gaps, tmp_path):
    gaps.reserve("cr-0def", "trn2.48xlarge", network["zone"], capacity_block=False)
    launch(cloud, deployment(tmp_path, network, decode={"instance_type": "trn2.48xlarge", "capacity_block_id": "cr-0def"}))
    p, d = gaps.run_instances_wire  # one launch per type and reservation
    assert d["CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId"] == "cr-0def"
    assert "InstanceMarketOptions.MarketType" not in d and not any(k.startswith("Placement.") for k in d)
    assert p["Placement.GroupName"] == "neuron-disagg-t1"  # P has no reservation: the cluster group


@pytest.mark.parametrize("reservation, message", [
    ({"instance_type": "p5en.48xlarge"}, "it reserves p5en.48xlarge, not trn2.48xlarge"),
    ({"zone": "elsewhere"}, "it is in elsewhere but the subnet is in"),
    ({"state": "scheduled"}, "it starts at 2026-12-24"),
    ({"state": "expired"}, "its state is 'expired'"),
    ({"free": 1}, "1 of its 4 instances are free, 2 needed"),
    (None, "does not exist"),
])
def test_a_reservation_that_cannot_take_the_instances_fails_before_anything_is_created(
        cloud, network, baked_ami, gaps, ec2, tmp_path, reservation, message):
    if reservation is not None:
        gaps.reserve("cr-0abc", reservation.get("instance_type", "trn2.48xlarge"),
                     reservation.get("zone", network["zone"]), state=reservation.get("state", "active"),
                     free=reservation.get("free", 4))
    group = {"instance_type": "trn2.48xlarge", "capacity_block_id": "cr-0abc"}
    with pytest.raises(ReservationUnusable, match=message):
        launch(cloud, deployment(tmp_path, network, prefill=group, decode=group))
    assert gaps.placement_groups == {} and gaps.run_instances_wire == []
    assert not ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["neuron-disagg-t1"]}])[
        "SecurityGroups"]


def test_a_full_reservation_at_launch_says_so_instead_of_advising_to_buy_one(cloud, network, baked_ami, gaps, ec2,
                                                                             tmp_path):
    gaps.reserve("cr-0abc", "trn2.48xlarge", network["zone"])
    gaps.fail_run_instances = ("ReservationCapacityExceeded", "The requested reservation does not have sufficient "
                                                              "compatible and available capacity for this request.")
    gaps.fail_after = 1  # P (no reservation) starts, then D's reservation is full
    group = {"instance_type": "trn2.48xlarge", "capacity_block_id": "cr-0abc"}
    with pytest.raises(ReservationUnusable) as err:
        launch(cloud, deployment(tmp_path, network, decode=group))
    assert "cr-0abc has no free" in str(err.value) and "offerings" not in str(err.value)
    assert "terminated the 1 instance(s)" in str(err.value) and instances_of(ec2) == []


def test_an_unexpected_failure_midway_still_terminates_what_was_launched(cloud, network, baked_ami, gaps, ec2,
                                                                         tmp_path):
    gaps.raise_on_run_instances = ReadTimeoutError(endpoint_url="https://ec2.us-east-2.amazonaws.com")
    gaps.fail_after = 1  # P's type starts, then D's call times out
    register_image(ec2, "neuron-disagg-cuda-test", "cuda")
    with pytest.raises(ReadTimeoutError):
        launch(cloud, deployment(tmp_path, network, decode={"instance_type": "p5en.48xlarge"}))
    assert instances_of(ec2) == []
    assert "launch stopped by ReadTimeoutError: terminated the 1 instance(s)" in cloud.log.getvalue()


def test_without_a_baked_ami_launch_refuses_the_plain_dlami(cloud, network, public_parameters, gaps, ec2, tmp_path):
    public_parameters.values[ami.DLAMI_PARAMETERS["neuron"]] = register_image(ec2, "stand-in-for-the-neuron-dlami")
    with pytest.raises(ami.AmiNotFound, match="boot but not serve.*ami/build.sh.*allow_stock_ami"):
        launch(cloud, deployment(tmp_path, network))
    assert gaps.run_instances_wire == [] and gaps.placement_groups == {}


def test_an_ami_id_that_is_not_ours_is_refused_too(cloud, network, gaps, ec2, tmp_path):
    stock = register_image(ec2, "someone-elses-image")
    with pytest.raises(ami.AmiNotFound, match=f"ami_id {stock} is not a neuron-disagg AMI"):
        launch(cloud, deployment(tmp_path, network, ami_id=stock))
    assert gaps.run_instances_wire == []


def test_with_allow_stock_ami_the_dlami_comes_from_ssm(cloud, network, public_parameters, ec2, tmp_path):
    stock = register_image(ec2, "stand-in-for-the-neuron-dlami")  # untagged: not ours
    public_parameters.values[ami.DLAMI_PARAMETERS["neuron"]] = stock
    launch(cloud, deployment(tmp_path, network, allow_stock_ami=True))
    assert public_parameters.asked == [ami.DLAMI_PARAMETERS["neuron"]]
    assert {i["ImageId"] for i in instances_of(ec2)} == {stock}
    assert "lacks the neuron-disagg systemd units" in cloud.log.getvalue()


def test_missing_secret_fails_before_any_aws_call(cloud, network, gaps, ec2, tmp_path, monkeypatch):
    monkeypatch.delenv("NEURON_DISAGG_SECRET")
    with pytest.raises(ConfigError, match="openssl rand -hex 32"):
        launch(cloud, deployment(tmp_path, network))
    assert gaps.placement_groups == {} and instances_of(ec2) == []


def test_no_baked_ami_and_no_dlami_parameter_says_how_to_fix_it(cloud, network, public_parameters, gaps, tmp_path):
    with pytest.raises(ami.AmiNotFound, match="set ami_id in the deployment config, or bake an AMI"):
        launch(cloud, deployment(tmp_path, network, allow_stock_ami=True))
    assert gaps.run_instances_wire == []
    assert public_parameters.asked == [ami.DLAMI_PARAMETERS["neuron"]]


def test_a_zone_that_does_not_offer_the_type_fails_before_anything_is_created(cloud, network, baked_ami, gaps, ec2,
                                                                             tmp_path):
    # moto carries AWS's offerings: of us-east-2's zones only us-east-2c offers trn1.32xlarge
    with pytest.raises(SubnetUnusable, match=f"{REGION}a does not offer trn1.32xlarge; it is offered in "
                                             f"{REGION}c: use a subnet there"):
        launch(cloud, deployment(tmp_path, network, decode={"instance_type": "trn1.32xlarge"}))
    assert gaps.placement_groups == {} and gaps.run_instances_wire == []


@pytest.mark.parametrize("route", ["igw", None])
def test_a_subnet_the_instances_cannot_reach_out_of_fails_before_anything_is_created(cloud, network, baked_ami, gaps,
                                                                                    ec2, tmp_path, route):
    ec2.delete_route(RouteTableId=network["route_table"], DestinationCidrBlock="0.0.0.0/0")
    if route == "igw":  # a public subnet's route: useless to instances without a public IP
        ec2.create_route(RouteTableId=network["route_table"], DestinationCidrBlock="0.0.0.0/0", GatewayId=network["igw"])
    with pytest.raises(SubnetUnusable, match="could not read the deployment secret.*NAT gateway") as err:
        launch(cloud, deployment(tmp_path, network))
    assert ("no public IP" in str(err.value)) == (route == "igw")
    assert gaps.placement_groups == {} and gaps.run_instances_wire == []


def test_without_a_route_out_only_a_model_on_the_image_can_launch(cloud, network, baked_ami, gaps, ec2, tmp_path):
    """An SSM endpoint carries the secret, but a Hugging Face model downloads at every vLLM start: hosts
    that cannot download it never serve, so launch refuses them before anything exists."""
    ec2.delete_route(RouteTableId=network["route_table"], DestinationCidrBlock="0.0.0.0/0")
    ec2.create_vpc_endpoint(VpcId=network["vpc_id"], ServiceName=f"com.amazonaws.{REGION}.ssm",
                            VpcEndpointType="Interface", SubnetIds=[network["subnet_id"]])
    with pytest.raises(SubnetUnusable, match="could not download Qwen/Qwen3-32B from Hugging Face.*NAT gateway.*"
                                             "a path the image already holds"):
        launch(cloud, deployment(tmp_path, network))
    assert gaps.placement_groups == {} and gaps.run_instances_wire == []
    launch(cloud, deployment(tmp_path, network, model="/opt/models/Qwen3-32B"))
    assert len(instances_of(ec2)) == 2
    assert "the model is a path on the image" in cloud.log.getvalue()
