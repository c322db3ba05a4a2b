"""The account's On-Demand vCPU quotas are checked before launch creates anything, through Service
Quotas, naming the quota, its code and the shortfall.

The lookups' request and response shapes are checked against botocore's own model with its Stubber;
the launches run against moto as a server, whose Service Quotas lacks EC2's quotas: conftest's
``ServiceQuotas`` answers those (same shapes), and moto keeps everything else (instances, groups,
the secret)."""

from __future__ import annotations

import io

import pytest
from botocore.stub import Stubber

from neuron_disagg.deploy import cli, quotas
from neuron_disagg.deploy.cloud import Cloud
from neuron_disagg.deploy.errors import QuotaExceeded
from neuron_disagg.deploy.launch import launch

from .conftest import REGION, register_image, write_config
from .test_launch import deployment, instances_of

TRN, P = "L-2C3B7624", "L-417A185B"


def nothing_created(gaps, ec2, ssm) -> bool:
    groups = {g["GroupName"] for g in ec2.describe_security_groups()["SecurityGroups"]}
    return (gaps.placement_groups == {} and gaps.run_instances_wire == [] and groups == {"default"}
            and ssm.describe_parameters()["Parameters"] == [])


def quota(code: str, name: str, value: float) -> dict:
    return {"Quota": {"ServiceCode": "ec2", "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
                      "QuotaArn": f"arn:aws:servicequotas:{REGION}:123456789012:ec2/{code}", "QuotaCode": code,
                      "QuotaName": name, "Value": value, "Unit": "None", "Adjustable": True, "GlobalQuota": False,
                      "UsageMetric": {"MetricNamespace": "AWS/Usage", "MetricName": "ResourceCount",
                                      "MetricDimensions": {"Class": "Trn/OnDemand", "Resource": "vCPU",
                                                           "Service": "EC2", "Type": "Resource"},
                                      "MetricStatisticRecommendation": "Maximum"}}}


def test_the_quota_is_the_applied_value_else_awss_default(session):
    """Against botocore's model (Stubber validates parameters and answers): an account that never had
    the quota raised has no applied value, GetServiceQuota answers NoSuchResourceException."""
    client = session.client("service-quotas")
    family = quotas.family_of("trn2.48xlarge")
    assert (family.name, family.code) == ("Running On-Demand Trn instances", TRN)
    assert quotas.family_of("p5en.48xlarge").code == P and quotas.family_of("m6i.2xlarge") is None
    with Stubber(client) as stub:
        expected = {"ServiceCode": "ec2", "QuotaCode": TRN}
        stub.add_response("get_service_quota", quota(TRN, "Running On-Demand Trn instances", 384.0), expected)
        stub.add_client_error("get_service_quota", "NoSuchResourceException", "no applied value", 400,
                              expected_params=expected)
        stub.add_response("get_aws_default_service_quota", quota(TRN, "Running On-Demand Trn instances", 0.0), expected)
        cloud = Cloud(session, log=io.StringIO(), clients={"service-quotas": client})
        assert quotas.quota_vcpus(cloud, family) == (384.0, "Running On-Demand Trn instances")
        assert quotas.quota_vcpus(cloud, family) == (0.0, "Running On-Demand Trn instances")
        stub.assert_no_pending_responses()


def test_a_launch_the_trn_quota_cannot_take_is_refused_before_anything_is_created(cloud, network, baked_ami, gaps,
                                                                                  ec2, ssm, service_quotas, tmp_path):
    del service_quotas.applied[TRN]  # a new account: AWS's default, 0
    with pytest.raises(QuotaExceeded) as err:
        launch(cloud, deployment(tmp_path, network))
    message = str(err.value)
    for said in ("quota 'Running On-Demand Trn instances' (L-2C3B7624) in us-east-2 allows 0 vCPUs",
                 "0 are in use and this launch needs 384 more, for 2 x trn2.48xlarge (192 vCPUs each): 384 short",
                 "Nothing was created", "--quota-code L-2C3B7624 --desired-value 384", "Capacity Block"):
        assert said in message, said
    assert service_quotas.asked == [("GetServiceQuota", TRN), ("GetAWSDefaultServiceQuota", TRN)]
    assert nothing_created(gaps, ec2, ssm)


def test_instances_already_running_in_the_family_count_against_it(cloud, network, baked_ami, gaps, ec2, ssm,
                                                                  service_quotas, tmp_path):
    service_quotas.applied[TRN] = 384.0
    ec2.run_instances(ImageId=baked_ami, InstanceType="trn1.32xlarge", MinCount=1, MaxCount=1)  # 128 vCPUs
    gaps.run_instances_wire.clear()  # that one was not launch's
    with pytest.raises(QuotaExceeded, match="allows 384 vCPUs; 128 are in use and this launch needs 384 more.*128 "
                                            "short.*--desired-value 512"):
        launch(cloud, deployment(tmp_path, network))
    assert nothing_created(gaps, ec2, ssm)
    service_quotas.applied[TRN] = 512.0
    launch(cloud, deployment(tmp_path, network))
    assert len(instances_of(ec2)) == 2


def test_p5en_is_held_to_the_p_quota(cloud, network, gaps, ec2, ssm, service_quotas, tmp_path):
    register_image(ec2, "neuron-disagg-cuda-test", "cuda")
    service_quotas.applied[P] = 192.0
    p5en = {"instance_type": "p5en.48xlarge"}
    with pytest.raises(QuotaExceeded, match=r"'Running On-Demand P instances' \(L-417A185B\) .* allows 192 vCPUs.*"
                                            r"2 x p5en.48xlarge \(192 vCPUs each\): 192 short"):
        launch(cloud, deployment(tmp_path, network, prefill=p5en, decode=p5en))
    assert nothing_created(gaps, ec2, ssm)


def test_a_capacity_block_needs_no_on_demand_quota(cloud, network, baked_ami, gaps, ec2, service_quotas, tmp_path):
    del service_quotas.applied[TRN]
    gaps.reserve("cr-0abc", "trn2.48xlarge", network["zone"])
    group = {"instance_type": "trn2.48xlarge", "capacity_block_id": "cr-0abc"}
    launch(cloud, deployment(tmp_path, network, prefill=group, decode=group))
    assert len(instances_of(ec2)) == 2 and service_quotas.asked == []


def test_without_permission_to_read_quotas_launch_warns_and_goes_on(cloud, network, baked_ami, ec2, service_quotas,
                                                                    tmp_path):
    service_quotas.denied = True
    launch(cloud, deployment(tmp_path, network))
    assert "WARNING: cannot read the quota 'Running On-Demand Trn instances' (L-2C3B7624)" in cloud.log.getvalue()
    assert len(instances_of(ec2)) == 2


def test_the_cli_says_the_shortfall_and_exits_as_for_a_quota(monkeypatch, session, instance_profile, network,
                                                            baked_ami, service_quotas, tmp_path, capsys):
    monkeypatch.setattr(cli, "new_session", lambda region: session)
    service_quotas.applied[TRN] = 0.0
    code = cli.main(["launch", str(write_config(tmp_path, network)), "--yes"])
    assert code == QuotaExceeded.exit_code
    assert "neuron-disagg launch: the account's quota 'Running On-Demand Trn instances'" in capsys.readouterr().err
