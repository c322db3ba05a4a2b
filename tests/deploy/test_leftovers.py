"""status and teardown with a deployment partly gone: status says how the router is reached and what
is left besides instances; teardown removes every security group of the deployment (one per VPC it
ran in), every SecureString launch stored for it (under any name), and its instance profile and
role, and nothing of anyone else's. Against moto as a server (its IAM, SSM and EC2)."""

from __future__ import annotations

import io

import pytest

from neuron_disagg.deploy import cli, instance_profile
from neuron_disagg.deploy import status as deploy_status
from neuron_disagg.deploy.launch import launch
from neuron_disagg.deploy.teardown import teardown

from .conftest import INSTANCE_PROFILE, REGION, deny, write_config
from .test_launch import deployment, instances_of


def terminate_by_hand(ec2, name: str = "t1") -> None:
    """What a launch interrupted, or instances ended in the console, leave: the rest of the deployment."""
    ids = [i["InstanceId"] for i in instances_of(ec2, name)]
    ec2.terminate_instances(InstanceIds=ids)


def second_vpc(ec2) -> str:
    """A private subnet, routed through a NAT gateway, in a VPC of its own."""
    vpc = ec2.create_vpc(CidrBlock="10.30.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.30.1.0/24", AvailabilityZone=f"{REGION}a")["Subnet"]["SubnetId"]
    public = ec2.create_subnet(VpcId=vpc, CidrBlock="10.30.2.0/24", AvailabilityZone=f"{REGION}a")["Subnet"]["SubnetId"]
    igw = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=igw, VpcId=vpc)
    nat = ec2.create_nat_gateway(SubnetId=public, AllocationId=ec2.allocate_address(Domain="vpc")["AllocationId"])
    table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat["NatGateway"]["NatGatewayId"])
    ec2.associate_route_table(RouteTableId=table, SubnetId=subnet)
    return subnet


def test_status_says_the_router_is_reachable_only_from_the_deployments_own_instances(cloud, network, baked_ami,
                                                                                       tmp_path):
    launch(cloud, deployment(tmp_path, network))
    out = io.StringIO()
    deploy_status.print_status(deploy_status.status(cloud, "t1"), "t1", 8000, out)
    line = next(line for line in out.getvalue().splitlines() if line.startswith("router:"))
    assert "reachable only from the deployment's own instances" in line and "through SSM" in line
    assert "inside the VPC" not in out.getvalue()


def test_status_shows_what_is_left_of_a_deployment_besides_its_instances(monkeypatch, session, cloud, network,
                                                                        baked_ami, ec2, tmp_path, capsys):
    config = deployment(tmp_path, network)
    launched = launch(cloud, config)
    instance_profile.create(cloud, config)
    terminate_by_hand(ec2)
    monkeypatch.setattr(cli, "new_session", lambda region: session)
    assert cli.main(["status", str(write_config(tmp_path, network))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "deployment t1: no instances"
    assert lines[1] == "secret: SecureString /neuron-disagg/t1/secret exists (created by launch)"
    assert lines[2] == (f"also in the account: security group neuron-disagg-t1 ({launched.security_group_id}, "
                        f"{network['vpc_id']}); placement group neuron-disagg-t1; instance profile and role "
                        "neuron-disagg-t1 (`neuron-disagg teardown` removes them)")
    teardown(cloud, "t1", secret_parameter_name="/neuron-disagg/t1/secret", timeout_s=30, poll_s=0.1)
    assert deploy_status.resources(cloud, "t1") == []


def test_teardown_deletes_the_security_group_of_every_vpc_the_deployment_ran_in(cloud, network, baked_ami, ec2,
                                                                              tmp_path):
    first = launch(cloud, deployment(tmp_path, network))
    terminate_by_hand(ec2)
    second = launch(cloud, deployment(tmp_path, network, subnet_id=second_vpc(ec2)))
    assert second.security_group_id != first.security_group_id  # a group name is unique per VPC only
    result = teardown(cloud, "t1", secret_parameter_name="/neuron-disagg/t1/secret", timeout_s=30, poll_s=0.1)
    left = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["neuron-disagg-t1"]}])
    assert left["SecurityGroups"] == []
    assert sorted(result.security_groups_deleted) == sorted([first.security_group_id, second.security_group_id])


def test_teardown_deletes_a_securestring_left_under_an_earlier_name(cloud, network, baked_ami, ec2, ssm, tmp_path):
    launch(cloud, deployment(tmp_path, network, secret_ssm_parameter="/team/t1-secret"))
    terminate_by_hand(ec2)
    launch(cloud, deployment(tmp_path, network))  # secret_ssm_parameter dropped: the default name now
    ssm.put_parameter(Name="/team/other", Value="x" * 32, Type="SecureString")  # someone else's
    result = teardown(cloud, "t1", secret_parameter_name="/neuron-disagg/t1/secret", timeout_s=30, poll_s=0.1)
    assert [p["Name"] for p in ssm.describe_parameters()["Parameters"]] == ["/team/other"]
    assert sorted(result.secret_parameters_deleted) == ["/neuron-disagg/t1/secret", "/team/t1-secret"]


def test_teardown_deletes_the_deployments_instance_profile_and_role_and_no_other(cloud, session, network, baked_ami,
                                                                               tmp_path):
    config = deployment(tmp_path, network, iam_instance_profile="neuron-disagg-t1")
    instance_profile.create(cloud, config)
    launch(cloud, config)
    iam = session.client("iam")
    result = teardown(cloud, "t1", secret_parameter_name=config.secret_parameter, timeout_s=30, poll_s=0.1)
    profiles = {p["InstanceProfileName"] for p in iam.list_instance_profiles()["InstanceProfiles"]}
    roles = {r["RoleName"] for r in iam.list_roles()["Roles"]}
    assert "neuron-disagg-t1" not in profiles and "neuron-disagg-t1" not in roles
    assert INSTANCE_PROFILE in profiles and INSTANCE_PROFILE in roles  # the user's own: left alone
    assert result.instance_profile_deleted
    assert not teardown(cloud, "t1", timeout_s=30, poll_s=0.1).anything  # run again: nothing left, no error


def test_teardown_can_keep_the_instance_profile_for_a_relaunch(cloud, session, network, baked_ami, tmp_path):
    config = deployment(tmp_path, network, iam_instance_profile="neuron-disagg-t1")
    instance_profile.create(cloud, config)
    launch(cloud, config)
    result = teardown(cloud, "t1", timeout_s=30, poll_s=0.1, keep_instance_profile=True)
    assert result.terminated and not result.instance_profile_deleted
    assert session.client("iam").get_instance_profile(InstanceProfileName="neuron-disagg-t1")


@pytest.mark.parametrize("tags", [{}, {"neuron-disagg:deployment": "t1"}], ids=["untagged", "not-created-by-us"])
def test_a_role_of_the_deployments_name_the_user_made_is_left_alone(cloud, session, tags):
    iam = session.client("iam")
    iam.create_role(RoleName="neuron-disagg-t1", AssumeRolePolicyDocument="{}",
                    Tags=[{"Key": k, "Value": v} for k, v in tags.items()])
    iam.create_instance_profile(InstanceProfileName="neuron-disagg-t1")
    assert not teardown(cloud, "t1", timeout_s=30, poll_s=0.1).instance_profile_deleted
    assert iam.get_role(RoleName="neuron-disagg-t1") and iam.get_instance_profile(InstanceProfileName="neuron-disagg-t1")


def test_teardown_without_iam_permission_removes_the_rest_and_says_what_is_left(cloud, network, baked_ami, ec2,
                                                                              monkeypatch, tmp_path):
    launched = launch(cloud, deployment(tmp_path, network))
    deny(cloud, monkeypatch, "iam")
    result = teardown(cloud, "t1", secret_parameter_name="/neuron-disagg/t1/secret", timeout_s=30, poll_s=0.1)
    assert result.terminated and result.security_groups_deleted == [launched.security_group_id]
    assert not result.instance_profile_deleted
    assert "could not delete instance profile and role neuron-disagg-t1" in cloud.log.getvalue()
