"""`neuron-disagg launch | status | teardown` as a user runs them: flags, output, exit codes."""

from __future__ import annotations

import base64
import datetime
import io
import json
import os
import subprocess
import sys

import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber

from neuron_disagg.deploy import cli
from neuron_disagg.deploy.capacity import offerings, print_offerings
from neuron_disagg.deploy.cloud import Cloud, translate
from neuron_disagg.deploy.cost import LaunchNotConfirmed
from neuron_disagg.deploy.errors import MissingCredentials, PermissionDenied, QuotaExceeded

from .conftest import REGION, SECRET, register_image, subnet_in, write_config

pytestmark = pytest.mark.integration  # moto as a server process, and the installed command


@pytest.fixture
def use_session(monkeypatch, session, instance_profile):
    """The CLI's boto3 session is the test's (moto endpoint + the stand-ins for moto's gaps), in an
    account that holds the instance profile the test configs name."""
    monkeypatch.setattr(cli, "new_session", lambda region: session)
    return session


def dry_run_records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_dry_run_prints_every_call_and_makes_none(aws_env, network, gaps, ec2, tmp_path, monkeypatch, capsys):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "NEURON_DISAGG_SECRET"):
        monkeypatch.delenv(var)  # a dry run needs neither credentials nor the secret
    monkeypatch.setattr(cli, "new_session", lambda region: pytest.fail("a dry run must not open a session"))

    code = cli.main(["launch", str(write_config(tmp_path, network)), "--dry-run", "--prefill", "2"])

    out, err = capsys.readouterr()
    assert code == 0, err
    records = dry_run_records(out)
    operations = [r["operation"] for r in records]
    for expected in ("ec2:DescribeInstanceTypes", "ec2:DescribeImages", "ssm:GetParameter", "ec2:DescribeSubnets",
                     "ec2:CreatePlacementGroup", "ec2:CreateSecurityGroup", "ec2:AuthorizeSecurityGroupIngress",
                     "ec2:AuthorizeSecurityGroupEgress"):
        assert expected in operations
    runs = [r["parameters"] for r in records if r["operation"] == "ec2:RunInstances"]
    assert len(runs) == 1 and runs[0]["MinCount"] == runs[0]["MaxCount"] == 3  # 2P1D of one type: one call
    named = [dict((t["Key"], t["Value"]) for t in r["parameters"]["Tags"])["Name"]
             for r in records if r["operation"] == "ec2:CreateTags" and any(t["Key"] == "Name" for t in r["parameters"]["Tags"])]
    assert named == ["t1-prefill-0", "t1-prefill-1", "t1-decode-0"]
    assert operations[-1] == "ec2:CreateTags"  # the router's host learns its peers last
    assert all(p["Placement"] == {"GroupName": "neuron-disagg-t1"} for p in runs)
    assert "efa-only" in runs[0]["NetworkInterfaces"] and "DescribeInstanceTypes" in runs[0]["NetworkInterfaces"]
    assert "ssm get-parameter" in runs[0]["UserData"] and SECRET not in out
    put = [r["parameters"] for r in records if r["operation"] == "ssm:PutParameter"]
    assert put == [{"Name": "/neuron-disagg/t1/secret", "Value": "<redacted>", "Type": "SecureString",
                    "Description": "neuron-disagg deployment secret of t1 (HMAC key of KV registrations)",
                    "Tags": [{"Key": "neuron-disagg:created-by", "Value": "launch"},
                             {"Key": "neuron-disagg:deployment", "Value": "t1"}]}]
    assert operations.index("ssm:PutParameter") < operations.index("ec2:RunInstances")
    assert f"{len(records)} calls printed, none made" in err
    # nothing happened in moto
    assert gaps.placement_groups == {} and gaps.run_instances_wire == []
    assert ec2.describe_instances()["Reservations"] == []
    assert [g["GroupName"] for g in ec2.describe_security_groups()["SecurityGroups"]] == ["default", "default"]


@pytest.mark.parametrize("inline", [False, True], ids=["ssm", "secret_in_user_data"])
def test_dry_run_never_shows_the_secret(aws_env, network, tmp_path, capsys, inline):
    """With the secret at hand (NEURON_DISAGG_SECRET is set by aws_env), in neither mode does it reach
    stdout or stderr, in clear or in base64."""
    flags = ["--secret-in-user-data"] if inline else []
    code = cli.main(["launch", str(write_config(tmp_path, network)), "--dry-run", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    for shown in (SECRET, base64.b64encode(SECRET.encode()).decode()):
        assert shown not in out and shown not in err
    operations = [r["operation"] for r in dry_run_records(out)]
    assert ("ssm:PutParameter" in operations) is not inline
    assert ("WARNING: secret_in_user_data" in err) is inline


def test_dry_run_of_the_installed_command_needs_no_aws_at_all(tmp_path):
    """The real `neuron-disagg` entry point, an endpoint nobody listens on, no credentials: still works."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "NEURON_DISAGG_SECRET"}
    env.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    done = subprocess.run([sys.executable, "-m", "neuron_disagg.cli", "teardown", "examples/qwen3-32b.yaml",
                           "--region", "us-east-2", "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    operations = [r["operation"] for r in dry_run_records(done.stdout)]
    assert operations[:2] == ["ec2:DescribeInstances", "ec2:TerminateInstances"]
    assert "ec2:DeleteSecurityGroup" in operations and "ec2:DeletePlacementGroup" in operations
    deletes = [r["parameters"] for r in dry_run_records(done.stdout) if r["operation"] == "ssm:DeleteParameter"]
    assert deletes == [{"Name": "/neuron-disagg/qwen3-32b/secret"}]


def test_launch_status_teardown_through_the_cli(use_session, network, baked_ami, ec2, tmp_path, capsys):
    config = str(write_config(tmp_path, network, prefill={"count": 1}, decode={"count": 1}))
    trn1_zone = subnet_in(ec2, network, f"{REGION}c")

    assert cli.main(["launch", config, "--instance-type", "trn1.32xlarge", "--name", "cli", "--subnet", trn1_zone,
                     "--yes"]) == 0
    out, err = capsys.readouterr()
    assert "2 x trn1.32xlarge: $21.50/h each" in err and "$1,032 a day" in err  # moto has no Price List API
    assert "1P1D launched" in err and "cli-prefill-0" in out and "<- router" in out
    assert "the secret is in SecureString /neuron-disagg/cli/secret; teardown deletes it" in err
    assert SECRET not in out + err

    assert cli.main(["status", config, "--name", "cli"]) == 0
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["NAME", "INSTANCE_ID", "ROLE", "INSTANCE_TYPE", "STATE"]
    assert any("cli-decode-0" in line and "trn1.32xlarge" in line for line in lines)
    assert lines[-2] == "secret: SecureString /neuron-disagg/cli/secret exists (created by launch)"
    assert lines[-1].startswith("also in the account: security group neuron-disagg-cli (sg-")

    assert cli.main(["status", config, "--name", "cli", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["deployment"] == "cli" and {i["role"] for i in listed["instances"]} == {"prefill", "decode"}
    assert listed["secret_parameter"] == {"name": "/neuron-disagg/cli/secret", "state": "exists (created by launch)"}

    assert cli.main(["teardown", config, "--name", "cli", "--poll-s", "0.1"]) == 0
    assert "torn down (2 instance(s) terminated, SecureString /neuron-disagg/cli/secret deleted)" in (
        capsys.readouterr().out)
    assert cli.main(["teardown", config, "--name", "cli", "--poll-s", "0.1"]) == 0
    assert "nothing to tear down" in capsys.readouterr().out
    assert cli.main(["status", config, "--name", "cli"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "deployment cli: no instances", "secret: SecureString /neuron-disagg/cli/secret does not exist"]


def test_a_live_launch_nobody_confirmed_creates_nothing(use_session, network, baked_ami, ec2, gaps, ssm, tmp_path,
                                                        capsys):
    """A live launch shows its cost and waits for a yes before anything bills."""
    config = str(write_config(tmp_path, network, max_hours=6))
    register_image(ec2, "neuron-disagg-cuda-test", "cuda")
    assert cli.main(["launch", config, "--instance-type", "p5en.48xlarge"]) == LaunchNotConfirmed.exit_code
    err = capsys.readouterr().err
    assert "launch t1 in us-east-2:\n  2 x p5en.48xlarge: $63.30/h each" in err
    assert "about $126.59 an hour, $3,038 a day" in err and "terminates 6 h after its first boot, reboots included (max_hours): at most about $760" in err
    assert "not launched: no terminal to confirm at; pass --yes to launch" in err
    assert ec2.describe_instances()["Reservations"] == [] and gaps.placement_groups == {}
    assert {g["GroupName"] for g in ec2.describe_security_groups()["SecurityGroups"]} == {"default"}
    assert ssm.describe_parameters()["Parameters"] == []


def test_launch_without_an_instance_profile_says_how_to_create_one(aws_env, network, tmp_path, capsys):
    config = str(write_config(tmp_path, network, iam_instance_profile=None))
    for dry_run in ([], ["--dry-run"]):  # a dry run shows what a launch would do: this one would not start
        assert cli.main(["launch", config, *dry_run]) == 2
        out, err = capsys.readouterr()
        assert out == "" and "neuron-disagg launch: no iam_instance_profile" in err
        assert "aws iam add-role-to-instance-profile" in err and "--secret-in-user-data" in err


def test_missing_credentials_exit_code_and_message(aws_env, network, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    code = cli.main(["status", str(write_config(tmp_path, network))])
    assert code == MissingCredentials.exit_code
    err = capsys.readouterr().err
    assert "no AWS credentials found" in err and "aws sso login" in err


def test_unsupported_instance_type_through_the_cli(use_session, network, tmp_path, capsys):
    # c7i.48xlarge has EFA (moto's data agrees with AWS) but no accelerator to serve from
    code = cli.main(["launch", str(write_config(tmp_path, network)), "--instance-type", "c7i.48xlarge"])
    assert code == 2
    assert "c7i.48xlarge has EFA but neither Neuron devices nor NVIDIA GPUs" in capsys.readouterr().err


def test_missing_required_fields_are_reported_together(aws_env, tmp_path, capsys):
    code = cli.main(["launch", str(write_config(tmp_path, None, prefill={"count": 1}, decode={"count": 1}))])
    assert code == 2
    err = capsys.readouterr().err
    assert "subnet_id (or --subnet)" in err and "decode.instance_type (or --instance-type)" in err


def test_capacity_block_offerings_are_listed(session, capsys):
    """moto has no Capacity Blocks: the EC2 client is under botocore's Stubber here."""
    client = session.client("ec2")
    start = datetime.datetime(2026, 12, 1, 11, 30, tzinfo=datetime.timezone.utc)
    with Stubber(client) as stub:
        stub.add_response("describe_capacity_block_offerings", {"CapacityBlockOfferings": [{
            "CapacityBlockOfferingId": "cb-0123456789abcdef0", "InstanceType": "trn2.48xlarge",
            "AvailabilityZone": "us-east-2b", "InstanceCount": 2, "StartDate": start,
            "EndDate": start + datetime.timedelta(hours=24), "CapacityBlockDurationHours": 24,
            "UpfrontFee": "1234.56", "CurrencyCode": "USD"}]},
            {"InstanceType": "trn2.48xlarge", "InstanceCount": 2, "CapacityDurationHours": 24})
        rows = offerings(Cloud(session, log=io.StringIO(), clients={"ec2": client}), "trn2.48xlarge", 2, 24)
        stub.assert_no_pending_responses()
    out = io.StringIO()
    print_offerings(rows, "trn2.48xlarge", 2, 24, out)
    text = out.getvalue()
    assert "cb-0123456789abcdef0  us-east-2b" in text and "1234.56 USD" in text
    assert "purchase-capacity-block" in text and "--capacity-block cr-" in text


@pytest.mark.parametrize("code, error_type, advice", [
    ("VcpuLimitExceeded", QuotaExceeded, "Service Quotas"),
    ("UnauthorizedOperation", PermissionDenied, "IAM policy"),
    ("AuthFailure", MissingCredentials, "aws configure"),
])
def test_aws_error_codes_become_typed_errors_with_advice(code, error_type, advice):
    exc = ClientError({"Error": {"Code": code, "Message": "no"}}, "RunInstances")
    translated = translate(exc, "RunInstances", {"InstanceType": "trn2.48xlarge"})
    assert isinstance(translated, error_type) and advice in str(translated)
