"""Checks launch makes before it creates anything in AWS: an ami_id baked for the
other platform, default routes that do or do not lead out of the VPC, and limits EC2 enforces only
once RunInstances or CreateTags runs (user data size, tags per resource, root volume size).

moto serves the images and route tables. What it lacks stands in here, visible in each test: moto
reports every image's root snapshot as 15 GiB and knows no Cloud WAN routes, so an ``after-call``
handler on the client (as conftest's ``MotoGaps`` does) edits its answer.
"""

from __future__ import annotations

import io

import pytest

from neuron_disagg.deploy import ami, preflight, sizing, user_data
from neuron_disagg.deploy.cloud import DryRunCloud
from neuron_disagg.deploy.errors import AmiNotFound, AmiWrongPlatform, LaunchLimitExceeded
from neuron_disagg.deploy.instance_types import InstanceTypeInfo
from neuron_disagg.deploy.launch import instance_tags, launch, plan_launches
from neuron_disagg.deploy.preflight import SubnetUnusable
from neuron_disagg.deploy.settings import DeploymentConfig

from .conftest import REGION, register_image, write_config


def deployment(tmp_path, network=None, **values) -> DeploymentConfig:
    return DeploymentConfig.from_yaml(write_config(tmp_path, network, **values))


def edit_answers(cloud, operation: str, edit) -> None:
    """Lets ``edit(parsed)`` change what moto answers to ``operation`` on the cloud's EC2 client."""
    cloud.client("ec2").meta.events.register(f"after-call.ec2.{operation}", lambda parsed, **_: edit(parsed))


# -- ami_id and the instances' platform -------------------------------------------------------------------

@pytest.mark.parametrize("allow_stock", [False, True])
def test_an_ami_id_baked_for_the_other_platform_is_refused(cloud, ec2, allow_stock):
    neuron_image = register_image(ec2, "neuron-disagg-neuron", "neuron")
    with pytest.raises(AmiWrongPlatform) as err:
        ami.resolve(cloud, "cuda", neuron_image, allow_stock=allow_stock)
    message = str(err.value)
    for said in (neuron_image, "neuron-disagg:platform=neuron", "(cuda)", "ami/build.sh -only=amazon-ebs.cuda",
                 "leave ami_id unset"):
        assert said in message
    assert err.value.exit_code == 2 and isinstance(err.value, AmiNotFound)


def test_an_ami_id_of_the_instances_platform_or_a_stock_one_allowed_still_resolves(cloud, ec2):
    cuda_image = register_image(ec2, "neuron-disagg-cuda", "cuda")
    stock = register_image(ec2, "someone-elses-image")
    assert ami.resolve(cloud, "cuda", cuda_image) == (cuda_image, "ami_id in the deployment config")
    assert ami.resolve(cloud, "cuda", stock, allow_stock=True)[0] == stock
    with pytest.raises(AmiNotFound, match="is not a neuron-disagg AMI") as err:
        ami.resolve(cloud, "cuda", stock)
    assert not isinstance(err.value, AmiWrongPlatform)


def test_a_dry_run_does_not_look_at_the_ami_id():
    cloud = DryRunCloud(REGION, out=io.StringIO(), log=io.StringIO())
    assert ami.resolve(cloud, "cuda", "ami-0123456789abcdef0") == ("ami-0123456789abcdef0",
                                                                    "ami_id in the deployment config")
    assert cloud.calls == []


def test_one_ami_id_shared_by_trn2_and_p5en_fails_before_anything_is_created(cloud, network, gaps, ec2, tmp_path):
    neuron_image = register_image(ec2, "neuron-disagg-neuron", "neuron")
    config = deployment(tmp_path, network, ami_id=neuron_image, decode={"instance_type": "p5en.48xlarge"})
    with pytest.raises(AmiWrongPlatform, match=f"ami_id {neuron_image} is a neuron-disagg AMI for"):
        launch(cloud, config)
    assert gaps.placement_groups == {} and gaps.run_instances_wire == []
    assert ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["neuron-disagg-t1"]}])[
        "SecurityGroups"] == []


# -- default routes -----------------------------------------------------------------------------------------

def replace_default_route(ec2, network, **target) -> None:
    ec2.delete_route(RouteTableId=network["route_table"], DestinationCidrBlock="0.0.0.0/0")
    if target:
        ec2.create_route(RouteTableId=network["route_table"], DestinationCidrBlock="0.0.0.0/0", **target)


def test_a_default_route_through_vpc_peering_is_no_way_out(cloud, network, ec2):
    """The peer VPC has a NAT gateway of its own; peered traffic still never reaches it."""
    peer_vpc = ec2.create_vpc(CidrBlock="10.30.0.0/16")["Vpc"]["VpcId"]
    peering = ec2.create_vpc_peering_connection(VpcId=network["vpc_id"], PeerVpcId=peer_vpc)[
        "VpcPeeringConnection"]["VpcPeeringConnectionId"]
    ec2.accept_vpc_peering_connection(VpcPeeringConnectionId=peering)
    replace_default_route(ec2, network, VpcPeeringConnectionId=peering)
    with pytest.raises(SubnetUnusable, match=f"VPC peering connection {peering}, which reaches only the peer VPC"):
        preflight.check_outbound(cloud, network["subnet_id"], network["vpc_id"], reads_ssm=True)


def test_a_default_route_to_a_virtual_private_gateway_counts_as_a_way_out(cloud, network, ec2):
    """On-premises networks behind a VPN or Direct Connect often egress to the internet."""
    vgw = ec2.create_vpn_gateway(Type="ipsec.1")["VpnGateway"]["VpnGatewayId"]
    ec2.attach_vpn_gateway(VpcId=network["vpc_id"], VpnGatewayId=vgw)
    replace_default_route(ec2, network, GatewayId=vgw)
    preflight.check_outbound(cloud, network["subnet_id"], network["vpc_id"], reads_ssm=True)
    assert "WARNING" not in cloud.log.getvalue()


def test_a_default_route_to_a_cloud_wan_core_network_counts_as_a_way_out(cloud, network, ec2):
    replace_default_route(ec2, network)
    core_network = "arn:aws:networkmanager::123456789012:core-network/core-network-0123456789abcdef0"

    def cloud_wan_route(parsed):  # moto has no CoreNetworkArn routes
        for table in parsed.get("RouteTables", []):
            table["Routes"].append({"DestinationCidrBlock": "0.0.0.0/0", "CoreNetworkArn": core_network,
                                    "Origin": "CreateRoute", "State": "active"})

    edit_answers(cloud, "DescribeRouteTables", cloud_wan_route)
    preflight.check_outbound(cloud, network["subnet_id"], network["vpc_id"], reads_ssm=True)
    assert "WARNING" not in cloud.log.getvalue()


@pytest.mark.parametrize("route, out", [
    ({"NatGatewayId": "nat-0123"}, True), ({"TransitGatewayId": "tgw-0123"}, True),
    ({"InstanceId": "i-0123", "NetworkInterfaceId": "eni-0123"}, True), ({"NetworkInterfaceId": "eni-0123"}, True),
    ({"CoreNetworkArn": "arn:aws:networkmanager::1:core-network/core-network-0"}, True),
    ({"GatewayId": "vgw-0123"}, True), ({"GatewayId": "vpce-0123"}, True),
    ({"VpcPeeringConnectionId": "pcx-0123"}, False), ({"GatewayId": "igw-0123"}, False),
    ({"GatewayId": "local"}, False), ({"EgressOnlyInternetGatewayId": "eigw-0123"}, False),
])
def test_which_route_targets_reach_out(route, out):
    assert preflight.reaches_out({"DestinationCidrBlock": "0.0.0.0/0", **route}) is out


# -- user data size -----------------------------------------------------------------------------------------

def render_launches(config: DeploymentConfig) -> dict[str, str]:
    types = {t: InstanceTypeInfo.unknown(t) for t in (config.prefill.instance_type, config.decode.instance_type)}
    return {group.instance_type: user_data.render(config, [(m.role, m.index) for m in group.members], secret=None,
                                                  hosts=sizing.plans(config, types), deadline_s=3600)
            for group in plan_launches(config)}


def test_user_data_over_16_kb_is_refused_saying_its_size_and_what_makes_it_large(tmp_path):
    # 64 prefill and 64 decode of one type start in one launch; long vLLM arguments go into both roles' files
    long_args = [f"--override-generation-config={'x' * 100}-{i}" for i in range(30)]
    config = deployment(tmp_path, subnet_id="subnet-0123", vllm_args=long_args,
                        prefill={"instance_type": "trn2.48xlarge", "count": 64},
                        decode={"instance_type": "trn2.48xlarge", "count": 64})
    script = render_launches(config)["trn2.48xlarge"]
    size = len(script.encode())
    assert size > preflight.USER_DATA_MAX_BYTES
    with pytest.raises(LaunchLimitExceeded) as err:
        preflight.check_user_data(script, "trn2.48xlarge")
    message = str(err.value)
    for said in (f"{size:,} bytes", "16,384", "before base64", "its 128 instances", "vLLM arguments",
                 "Shorten vllm_args", "lower prefill.count/decode.count"):
        assert said in message, said
    assert err.value.exit_code == 2


def test_the_largest_launch_with_ordinary_arguments_fits_in_user_data(tmp_path):
    config = deployment(tmp_path, subnet_id="subnet-0123", vllm_args=["--max-num-seqs=64", "--enable-prefix-caching"],
                        secret_in_user_data=True, iam_instance_profile=None,
                        prefill={"instance_type": "trn2.48xlarge", "count": 64},
                        decode={"instance_type": "trn2.48xlarge", "count": 64})
    for instance_type, script in render_launches(config).items():
        preflight.check_user_data(script, instance_type)


def test_the_user_data_limit_counts_bytes_not_characters():
    preflight.check_user_data("x" * preflight.USER_DATA_MAX_BYTES, "trn2.48xlarge")
    with pytest.raises(LaunchLimitExceeded, match="16,385 bytes"):
        preflight.check_user_data("x" * (preflight.USER_DATA_MAX_BYTES + 1), "trn2.48xlarge")
    with pytest.raises(LaunchLimitExceeded, match="18,000 bytes"):
        preflight.check_user_data("é" * 9000, "trn2.48xlarge")  # 9,000 characters, 2 bytes each


# -- tags per instance --------------------------------------------------------------------------------------

def own_tags(config: DeploymentConfig) -> tuple[dict[str, dict[str, str]], str]:
    members = [m for group in plan_launches(config) for m in group.members]
    return {m.name: instance_tags(config, m) for m in members}, next(m.name for m in members if m.router)


def test_more_than_50_tags_on_the_routers_host_is_refused_naming_the_counts(tmp_path):
    # 45 of the config's + neuron-disagg:deployment + Name, role, index, router: 50 on each instance;
    # the router's host has the peer tags besides (a count and one value for two addresses)
    config = deployment(tmp_path, subnet_id="subnet-0123", tags={f"team-{i}": "x" for i in range(45)})
    tags, router = own_tags(config)
    with pytest.raises(LaunchLimitExceeded) as err:
        preflight.check_tag_count(config, tags, router)
    message = str(err.value)
    for said in ("instance prefill-0 would carry 52 tags", "EC2 allows 50", "45 come from `tags`",
                 "7 are launch's own", "2 of them naming the 2 instances' addresses", "Remove at least 2 from `tags`"):
        assert said in message, said


def test_50_tags_on_every_instance_is_allowed(tmp_path):
    config = deployment(tmp_path, subnet_id="subnet-0123", router={"host": "decode"},
                        tags={f"team-{i}": "x" for i in range(43)}, prefill={"instance_type": "trn2.48xlarge",
                                                                             "count": 8})
    tags, router = own_tags(config)
    assert router == "decode-0"
    preflight.check_tag_count(config, tags, router)  # 43 + 5 + 2 peer tags (9 addresses fit in one value)


def test_the_router_hosts_peer_tags_are_counted_for_the_widest_addresses(tmp_path):
    """128 instances' "role@address" words, with 15-character addresses, take 13 tag values of up to
    256 characters (10 "prefill@..." or 11 "decode@..." words each), and a count: 14. With 31 config
    tags that is 31 + 5 + 14 = 50."""
    many = {"instance_type": "trn2.48xlarge", "count": 64}
    config = deployment(tmp_path, subnet_id="subnet-0123", prefill=many, decode=many,
                        tags={f"team-{i}": "x" for i in range(31)})
    tags, router = own_tags(config)
    preflight.check_tag_count(config, tags, router)
    config.tags["one-more"] = "x"
    with pytest.raises(LaunchLimitExceeded, match="51 tags.*14 of them naming the 128 instances' addresses"):
        preflight.check_tag_count(config, tags, router)


# -- root volume and the image's snapshot -------------------------------------------------------------------

def test_a_root_volume_smaller_than_the_images_snapshot_is_refused(cloud, ec2, tmp_path):
    image = register_image(ec2, "neuron-disagg-neuron", "neuron")

    def snapshot_of_600_gib(parsed):  # moto reports every image's root snapshot as 15 GiB
        for mapping in parsed["Images"][0]["BlockDeviceMappings"]:
            mapping["Ebs"]["VolumeSize"] = 600

    edit_answers(cloud, "DescribeImages", snapshot_of_600_gib)
    device, snapshot_gib = ami.root_volume(cloud, image)
    assert (device, snapshot_gib) == ("/dev/sda1", 600)
    config = deployment(tmp_path, subnet_id="subnet-0123")  # root_volume_gib: 500 by default
    with pytest.raises(LaunchLimitExceeded) as err:
        preflight.check_root_volume(config.root_volume_gib, image, snapshot_gib)
    for said in ("root_volume_gib is 500 GiB", f"600 GiB root snapshot of AMI {image}", "at least 600"):
        assert said in str(err.value), said
    preflight.check_root_volume(600, image, snapshot_gib)


def test_the_root_snapshot_size_comes_from_the_root_devices_mapping_only(cloud, ec2):
    image = register_image(ec2, "neuron-disagg-neuron", "neuron")

    def data_volume_besides(parsed):  # root named without /dev/, and a larger second volume
        found = parsed["Images"][0]
        found["RootDeviceName"] = "/dev/xvda"
        found["BlockDeviceMappings"] = [{"DeviceName": "/dev/sdb", "Ebs": {"VolumeSize": 900}},
                                        {"DeviceName": "xvda", "Ebs": {"VolumeSize": 120}}]

    edit_answers(cloud, "DescribeImages", data_volume_besides)
    assert ami.root_volume(cloud, image) == ("/dev/xvda", 120)
    assert ami.root_device(cloud, image) == "/dev/xvda"


def test_a_dry_run_knows_no_snapshot_size_and_checks_nothing():
    cloud = DryRunCloud(REGION, out=io.StringIO(), log=io.StringIO())
    device, snapshot_gib = ami.root_volume(cloud, "ami-0123456789abcdef0")
    assert snapshot_gib is None and device.startswith("<")
    preflight.check_root_volume(64, "ami-0123456789abcdef0", snapshot_gib)
