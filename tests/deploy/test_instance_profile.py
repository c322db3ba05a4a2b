"""Each deployment gets its own instance profile from one command, and launch
refuses a profile that cannot read its deployment's secret, naming the one it expects. The
walk-through (examples/README.md) for trn2 and for p5en, end to end against moto: profile, launch,
status, teardown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_disagg.deploy import cli, instance_profile
from neuron_disagg.deploy.instance_profile import ProfileCannotReadSecret
from neuron_disagg.deploy.launch import launch

from .conftest import deny, register_image
from .test_launch import deployment, instances_of, tags

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-32b.yaml"


@pytest.fixture
def walk_through(monkeypatch, session, network, ec2):
    """The CLI on the test's moto session, with an AMI of each platform baked."""
    monkeypatch.setattr(cli, "new_session", lambda region: session)
    register_image(ec2, "neuron-disagg-neuron", "neuron")
    register_image(ec2, "neuron-disagg-cuda", "cuda")
    return network


@pytest.mark.parametrize("family, instance_type", [("trn2", "trn2.48xlarge"), ("p5en", "p5en.48xlarge")])
def test_the_walk_through_end_to_end_on_either_platform(walk_through, ec2, session, family, instance_type, capsys):
    name = f"qwen3-32b-{family}"
    common = [str(EXAMPLE), "--name", name, "--region", "us-east-2"]
    assert cli.main(["instance-profile", *common]) == 0
    assert cli.main(["instance-profile", *common]) == 0  # again: nothing to add, no error
    assert f"instance profile neuron-disagg-{name}: ready" in capsys.readouterr().out

    policy = session.client("iam").get_role_policy(RoleName=f"neuron-disagg-{name}", PolicyName="neuron-disagg-secret")
    assert policy["PolicyDocument"]["Statement"][0]["Resource"] == f"arn:aws:ssm:*:*:parameter/neuron-disagg/{name}/secret"

    launch_args = ["launch", *common, "--instance-type", instance_type, "--subnet", walk_through["subnet_id"],
                   "--iam-instance-profile", f"neuron-disagg-{name}", "--yes"]
    assert cli.main(launch_args) == 0
    launched = instances_of(ec2, name)
    assert sorted(tags(i)["neuron-disagg:role"] for i in launched) == ["decode", "prefill"]
    assert {i["InstanceType"] for i in launched} == {instance_type}
    assert cli.main(["status", *common]) == 0
    assert "<- router" in capsys.readouterr().out
    assert cli.main(["teardown", *common, "--poll-s", "0.1"]) == 0
    assert instances_of(ec2, name) == []


def test_launching_p5en_with_the_trn2_deployments_profile_is_refused_naming_the_right_one(walk_through, ec2, capsys):
    """What examples/README.md used to lead a p5en user to: instances that boot, get AccessDenied, and bill."""
    trn2 = [str(EXAMPLE), "--name", "qwen3-32b-trn2", "--region", "us-east-2"]
    assert cli.main(["instance-profile", *trn2]) == 0
    code = cli.main(["launch", str(EXAMPLE), "--name", "qwen3-32b-p5en", "--region", "us-east-2", "--instance-type",
                     "p5en.48xlarge", "--subnet", walk_through["subnet_id"], "--iam-instance-profile",
                     "neuron-disagg-qwen3-32b-trn2", "--yes"])
    assert code == ProfileCannotReadSecret.exit_code
    err = capsys.readouterr().err
    assert "instance profile neuron-disagg-qwen3-32b-trn2 cannot be deployment qwen3-32b-p5en's" in err
    assert "no policy of its role (neuron-disagg-qwen3-32b-trn2) allows ssm:GetParameter on " \
           "/neuron-disagg/qwen3-32b-p5en/secret" in err
    assert "expects instance profile neuron-disagg-qwen3-32b-p5en" in err
    assert "neuron-disagg instance-profile CONFIG --name qwen3-32b-p5en" in err
    assert instances_of(ec2, "qwen3-32b-p5en") == []


def test_a_missing_profile_or_an_explicit_deny_is_refused_and_a_wide_one_accepted(cloud, session, network, baked_ami,
                                                                               tmp_path):
    with pytest.raises(ProfileCannotReadSecret, match="instance profile nope does not exist"):
        launch(cloud, deployment(tmp_path, network, iam_instance_profile="nope"))
    iam = session.client("iam")
    statement = {"Effect": "Deny", "Action": "ssm:Get*", "Resource": "arn:aws:ssm:*:*:parameter/neuron-disagg/t1/*"}
    iam.put_role_policy(RoleName="nd-test", PolicyName="deny", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [statement]}))
    with pytest.raises(ProfileCannotReadSecret, match="cannot be deployment t1's"):
        launch(cloud, deployment(tmp_path, network))
    iam.delete_role_policy(RoleName="nd-test", PolicyName="deny")
    launch(cloud, deployment(tmp_path, network))  # the fixture's role may read every parameter


def test_without_iam_read_permission_launch_warns_and_goes_on(cloud, network, baked_ami, ec2, tmp_path, monkeypatch):
    deny(cloud, monkeypatch, "iam")
    launch(cloud, deployment(tmp_path, network))
    assert "WARNING: cannot check that instance profile nd-test may read the secret" in cloud.log.getvalue()
    assert len(instances_of(ec2)) == 2


def test_iam_wildcards_and_case_are_read_as_iam_reads_them():
    target = "arn:aws:ssm:us-east-2:123456789012:parameter/neuron-disagg/d/secret"
    allow = lambda action, resource: {"Effect": "Allow", "Action": action, "Resource": resource}  # noqa: E731
    assert instance_profile._allows([allow("ssm:GetParameter", "arn:aws:ssm:*:*:parameter/neuron-disagg/d/secret")],
                                    "ssm:GetParameter", target)
    assert instance_profile._allows([allow(["SSM:getparameter*"], "*")], "ssm:GetParameter", target)
    assert instance_profile._allows([allow("*", ["arn:aws:ssm:us-east-2:123456789012:parameter/neuron-disagg/*"])],
                                    "ssm:GetParameter", target)
    assert not instance_profile._allows([allow("ssm:GetParameters", "*")], "ssm:GetParameter", target)
    assert not instance_profile._allows([allow("ssm:GetParameter", "arn:aws:ssm:*:*:parameter/neuron-disagg/e/*")],
                                        "ssm:GetParameter", target)
    assert not instance_profile._allows([allow("ssm:GetParameter", "arn:aws:ssm:*:*:parameter/neuron-disagg/[d]/secret")],
                                        "ssm:GetParameter", target)
