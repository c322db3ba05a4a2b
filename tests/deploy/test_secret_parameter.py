"""The deployment secret's path to the instances, against moto's SSM and IAM: by default launch puts
it into a SecureString named after the deployment (before any instance exists) and teardown deletes
it; without an instance profile to read it with, launch stops with the commands that create one;
`secret_in_user_data: true` is the explicit, warned-about alternative."""

from __future__ import annotations

import base64
import fnmatch
import io
import json
import re
import shlex

import pytest

from neuron_disagg.deploy.cloud import Cloud
from neuron_disagg.deploy.errors import DeployError, DeploymentConfigError
from neuron_disagg.deploy.launch import launch
from neuron_disagg.deploy.settings import DeploymentConfig
from neuron_disagg.deploy.teardown import teardown

from .conftest import SECRET, error, write_config
from .test_launch import instances_of, user_data

PARAMETER = "/neuron-disagg/t1/secret"


def deployment(tmp_path, network, **values) -> DeploymentConfig:
    return DeploymentConfig.from_yaml(write_config(tmp_path, network, **values))


def parameter_tags(ssm, name: str = PARAMETER) -> dict[str, str]:
    listed = ssm.list_tags_for_resource(ResourceType="Parameter", ResourceId=name)["TagList"]
    return {t["Key"]: t["Value"] for t in listed}


def parameter_missing(ssm, name: str = PARAMETER) -> bool:
    return ssm.describe_parameters(ParameterFilters=[{"Key": "Name", "Option": "Equals",
                                                      "Values": [name]}])["Parameters"] == []


def test_launch_stores_the_secret_as_a_secure_string_before_any_instance(cloud, session, network, baked_ami, gaps,
                                                                         ssm, tmp_path):
    instances_before_put: list[int] = []
    session.events.register("before-call.ssm.PutParameter",
                            lambda **_: instances_before_put.append(len(gaps.run_instances_wire)))

    result = launch(cloud, deployment(tmp_path, network, tags={"team": "inference"}))

    stored = ssm.get_parameter(Name=PARAMETER, WithDecryption=True)["Parameter"]
    assert stored["Type"] == "SecureString" and stored["Value"] == SECRET
    assert parameter_tags(ssm) == {"neuron-disagg:deployment": "t1", "neuron-disagg:created-by": "launch",
                                   "team": "inference"}
    assert instances_before_put == [0]  # stored before the first RunInstances
    assert result.secret_parameter == PARAMETER
    assert f"stored the deployment secret in SecureString {PARAMETER}" in cloud.log.getvalue()
    assert SECRET not in cloud.log.getvalue()


def test_relaunch_overwrites_the_parameter_launch_created(cloud, network, baked_ami, ec2, ssm, tmp_path, monkeypatch):
    first = launch(cloud, deployment(tmp_path, network))
    ec2.terminate_instances(InstanceIds=[p.instance_id for p in first.instances])
    monkeypatch.setenv("NEURON_DISAGG_SECRET", "a-new-secret-for-the-second-launch")

    launch(cloud, deployment(tmp_path, network, tags={"run": "2"}))

    stored = ssm.get_parameter(Name=PARAMETER, WithDecryption=True)["Parameter"]
    assert stored["Value"] == "a-new-secret-for-the-second-launch" and stored["Version"] == 2
    assert stored["Type"] == "SecureString"
    assert parameter_tags(ssm)["run"] == "2" and parameter_tags(ssm)["neuron-disagg:created-by"] == "launch"
    assert f"overwrote SecureString {PARAMETER}" in cloud.log.getvalue()


def test_launch_never_overwrites_a_parameter_it_did_not_create(cloud, network, baked_ami, gaps, ssm, tmp_path):
    ssm.put_parameter(Name="/team/shared-secret", Value="somebody-elses-value", Type="SecureString")

    with pytest.raises(DeployError, match="not created by launch of t1.*will not overwrite"):
        launch(cloud, deployment(tmp_path, network, secret_ssm_parameter="/team/shared-secret"))

    assert ssm.get_parameter(Name="/team/shared-secret", WithDecryption=True)["Parameter"]["Value"] == (
        "somebody-elses-value")
    assert gaps.run_instances_wire == []


def test_named_parameter_is_used_by_launch_user_data_and_teardown(cloud, network, baked_ami, ec2, ssm, tmp_path):
    launched = launch(cloud, deployment(tmp_path, network, secret_ssm_parameter="/prod/nd/t1-secret"))

    assert ssm.get_parameter(Name="/prod/nd/t1-secret", WithDecryption=True)["Parameter"]["Value"] == SECRET
    assert parameter_missing(ssm, PARAMETER)
    assert 'fetch_secure_string /prod/nd/t1-secret "$ETC/secret"' in user_data(ec2, launched.instances[0].instance_id)
    result = teardown(cloud, "t1", secret_parameter_name="/prod/nd/t1-secret", timeout_s=30, poll_s=0.1)
    assert result.secret_parameter_deleted == "/prod/nd/t1-secret" and parameter_missing(ssm, "/prod/nd/t1-secret")


def test_teardown_deletes_the_parameter_and_leaves_foreign_ones(cloud, network, baked_ami, ssm, tmp_path):
    launch(cloud, deployment(tmp_path, network))
    ssm.put_parameter(Name="/neuron-disagg/mine/secret", Value="x" * 32, Type="SecureString")  # made by hand

    result = teardown(cloud, "t1", secret_parameter_name=PARAMETER, timeout_s=30, poll_s=0.1)
    kept = teardown(cloud, "mine", secret_parameter_name="/neuron-disagg/mine/secret", timeout_s=30, poll_s=0.1)

    assert result.secret_parameter_deleted == PARAMETER and parameter_missing(ssm)
    assert f"deleted SecureString {PARAMETER}" in cloud.log.getvalue()
    assert not kept.secret_parameter_deleted and not parameter_missing(ssm, "/neuron-disagg/mine/secret")
    assert "leaving SSM parameter /neuron-disagg/mine/secret" in cloud.log.getvalue()


def test_teardown_without_permission_to_look_says_so_and_goes_on(cloud, session, network, baked_ami, ssm, tmp_path):
    denied = []  # the client copies the session's handlers when created: register first, deny later
    session.events.register("before-call.ssm.ListTagsForResource",
                            lambda **_: error("AccessDeniedException", "not allowed") if denied else None)
    launch(cloud, deployment(tmp_path, network))
    denied.append(True)

    result = teardown(cloud, "t1", secret_parameter_name=PARAMETER, timeout_s=30, poll_s=0.1)

    assert result.terminated and result.security_group_deleted and not result.secret_parameter_deleted
    assert f"could not check SSM parameter {PARAMETER}" in cloud.log.getvalue()
    assert f"aws ssm delete-parameter --name {PARAMETER}" in cloud.log.getvalue()
    assert not parameter_missing(ssm)


def test_without_an_instance_profile_launch_stops_before_any_aws_call(cloud, network, baked_ami, gaps, ssm, ec2,
                                                                      tmp_path):
    with pytest.raises(DeploymentConfigError) as err:
        launch(cloud, deployment(tmp_path, network, iam_instance_profile=None))

    message = str(err.value)
    assert message.startswith("no iam_instance_profile")
    assert f"SecureString {PARAMETER}" in message
    assert "aws iam create-instance-profile --instance-profile-name neuron-disagg-t1" in message
    assert "--iam-instance-profile neuron-disagg-t1" in message and "secret_in_user_data: true" in message
    assert parameter_missing(ssm) and gaps.placement_groups == {} and instances_of(ec2) == []


def aws_iam_commands(message: str) -> list[list[str]]:
    return [shlex.split(line.split("#")[0]) for line in message.splitlines() if line.strip().startswith("aws iam ")]


def test_the_commands_the_message_gives_create_a_profile_launch_accepts(session, network, baked_ami, ssm, tmp_path):
    """Run the message's `aws iam` commands (as boto3 calls, against moto): the JSON documents parse, the
    role may read this deployment's parameter and no other, and launch then works with the profile."""
    with pytest.raises(DeploymentConfigError) as err:
        deployment(tmp_path, network, iam_instance_profile=None).require_launchable()
    iam = session.client("iam")
    policies = {}
    for words in aws_iam_commands(str(err.value)):
        operation = words[2].replace("-", "_")
        assert operation != "attach_role_policy"  # no managed policy: AmazonSSMManagedInstanceCore reads any parameter
        options = {re.sub(r"(^|-)(\w)", lambda m: m.group(2).upper(), words[i][2:]): words[i + 1]
                   for i in range(3, len(words), 2)}
        if operation == "put_role_policy":
            policies[options["PolicyName"]] = json.loads(options["PolicyDocument"])
        getattr(iam, operation)(**options)
    assert iam.get_instance_profile(InstanceProfileName="neuron-disagg-t1")["InstanceProfile"]["Roles"][0][
        "RoleName"] == "neuron-disagg-t1"
    allowed = [(action, s["Resource"]) for p in policies.values() for s in p["Statement"]
               for action in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])]
    # What reads parameters, and on what (the documents' own globs; moto does not enforce IAM).
    readers = [resource for action, resource in allowed if action.startswith("ssm:GetParameter") or action == "ssm:*"]
    assert readers == [f"arn:aws:ssm:*:*:parameter{PARAMETER}"]
    other = "arn:aws:ssm:us-east-2:123456789012:parameter/neuron-disagg/another-deployment/secret"
    assert not any(fnmatch.fnmatchcase(other, glob) for glob in readers)
    assert fnmatch.fnmatchcase(f"arn:aws:ssm:us-east-2:123456789012:parameter{PARAMETER}", readers[0])
    kms = next(s for s in policies["neuron-disagg-secret"]["Statement"] if s["Action"] == "kms:Decrypt")
    assert kms["Condition"] == {"StringLike": {"kms:ViaService": "ssm.*.amazonaws.com"}}

    result = launch(Cloud(session, log=io.StringIO()),
                    deployment(tmp_path, network, iam_instance_profile="neuron-disagg-t1"))
    assert len(result.instances) == 2


def test_secret_in_user_data_needs_no_profile_and_warns(cloud, network, baked_ami, gaps, ec2, ssm, tmp_path):
    result = launch(cloud, deployment(tmp_path, network, iam_instance_profile=None, secret_in_user_data=True))

    script = user_data(ec2, result.instances[0].instance_id)
    assert base64.b64encode(SECRET.encode()).decode() in script and "ssm get-parameter" not in script
    assert parameter_missing(ssm) and result.secret_parameter == ""
    assert all("IamInstanceProfile.Name" not in w for w in gaps.run_instances_wire)
    log = cloud.log.getvalue()
    assert "WARNING: secret_in_user_data" in log and "ec2:DescribeInstanceAttribute" in log
    assert SECRET not in log


def test_secret_in_user_data_and_a_parameter_name_contradict(tmp_path):
    with pytest.raises(DeploymentConfigError, match="contradict"):
        DeploymentConfig.from_yaml(write_config(tmp_path, secret_in_user_data=True, secret_ssm_parameter="/a/b"))


# -- a Hugging Face token, for a gated model ----------------------------------------------------------------

HF = "/team/hf-token"


def test_a_gated_models_token_is_checked_before_anything_is_created(cloud, network, baked_ami, gaps, ec2, ssm,
                                                                    tmp_path):
    """Without the token every vLLM start of a gated model fails at its download: launch refuses a
    token parameter that does not exist, and the instances read one that does."""
    with pytest.raises(DeploymentConfigError, match=f"SecureString {HF} \\(the Hugging Face token\\) does not exist "
                                                    f"in us-east-2: create it, e.g. `aws ssm put-parameter --name {HF}"):
        launch(cloud, deployment(tmp_path, network, hf_token_ssm_parameter=HF))
    assert parameter_missing(ssm) and gaps.run_instances_wire == [] and gaps.placement_groups == {}
    ssm.put_parameter(Name=HF, Value="hf_0123456789abcdef", Type="SecureString")
    launched = launch(cloud, deployment(tmp_path, network, hf_token_ssm_parameter=HF))
    script = user_data(ec2, launched.instances[0].instance_id)
    assert f'fetch_secure_string {HF} "$ETC/hf-token" "the Hugging Face token"' in script
    assert "hf_0123456789abcdef" not in script


def test_the_instance_profile_must_read_the_token_too(cloud, network, baked_ami, ssm, tmp_path):
    ssm.put_parameter(Name=HF, Value="hf_0123456789abcdef", Type="SecureString")
    from neuron_disagg.deploy import instance_profile
    from neuron_disagg.deploy.instance_profile import ProfileCannotReadSecret

    instance_profile.create(cloud, deployment(tmp_path, network))  # made before the token was named
    config = deployment(tmp_path, network, hf_token_ssm_parameter=HF, iam_instance_profile="neuron-disagg-t1")
    with pytest.raises(ProfileCannotReadSecret, match=f"allows ssm:GetParameter on {HF}, so its instances could not "
                                                      "read the Hugging Face token at boot"):
        launch(cloud, config)
    instance_profile.create(cloud, config)  # run again with the token named: its policy covers both
    assert len(launch(cloud, config).instances) == 2


def test_a_token_needs_an_instance_profile_to_be_read_with(tmp_path):
    config = DeploymentConfig.from_yaml(write_config(tmp_path, {"subnet_id": "subnet-0abc"}, hf_token_ssm_parameter=HF,
                                                     secret_in_user_data=True, iam_instance_profile=None))
    with pytest.raises(DeploymentConfigError, match="read at boot with the instances' profile.*no iam_instance_profile"):
        config.require_launchable()
