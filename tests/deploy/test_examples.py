"""examples/: the scripts pass shellcheck, fail early with a clear message when a prerequisite is
missing, and (DRY_RUN=1) print the AWS calls of a real launch without making any; the local CPU
one really serves a request through the router."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from neuron_disagg.deploy.settings import missing_instance_profile_advice

from .test_user_data import shellcheck

pytestmark = pytest.mark.integration  # runs the example scripts and shellcheck

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No AWS credentials or secret from the caller; an endpoint nobody listens on, so any call fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "NEURON_DISAGG_SECRET"}
    env.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    env.update(extra)
    return env


def run(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(EXAMPLES / script), *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def calls(stdout: str, operation: str) -> list[dict]:
    return [r["parameters"] for r in map(json.loads, filter(None, stdout.splitlines())) if r["operation"] == operation]


def launches(stdout: str) -> list[dict]:
    return calls(stdout, "ec2:RunInstances")


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.sh")))
def test_example_scripts_pass_shellcheck(script):
    done = subprocess.run([shellcheck(), "-x", str(EXAMPLES / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("instance_type", ["trn2.48xlarge", "p5en.48xlarge"])
def test_dry_run_of_1p1d_on_either_platform_shares_one_config(tmp_path, instance_type):
    done = run("launch.sh", clean_env(tmp_path, DRY_RUN="1", AWS_REGION="us-east-2", SUBNET_ID="subnet-0abc",
                                      KEY_NAME="k", MAX_HOURS="8"), instance_type)
    assert done.returncode == 0, done.stderr
    params = launches(done.stdout)
    assert [(p["InstanceType"], p["MinCount"], p["MaxCount"]) for p in params] == [(instance_type, 2, 2)]
    assert all(p["KeyName"] == "k" and "printf 'MODEL=\"%s\"\\n' Qwen/Qwen3-32B" in p["UserData"] for p in params)
    assert all("'--tensor-parallel-size 8 --max-model-len 32768'" in p["UserData"] for p in params)
    # the one config, sized per platform: 8 instances of TP 8 fill a trn2.48xlarge, 1 a p5en.48xlarge
    instances, visible = (8, "NEURON_RT_VISIBLE_CORES") if instance_type.startswith("trn2") else (1, "CUDA_VISIBLE_DEVICES")
    assert all(f"for ((k = 0; k < {instances}; k++)); do" in p["UserData"] for p in params)
    assert all(f"printf '{visible}=\"%s\"\\n'" in p["UserData"] for p in params)
    assert f"prefill: {instance_type}: {instances} vLLM instance(s) per host, TP 8 each" in done.stderr
    # max_hours: an absolute time the guard keeps across reboots, not a shutdown a reboot forgets
    assert all("stop_at=$((BOOT_EPOCH + 480 * 60))" in p["UserData"] and "shutdown -h +480" not in p["UserData"]
               for p in params)
    assert all(p["InstanceInitiatedShutdownBehavior"] == "terminate" for p in params)
    assert calls(done.stdout, "service-quotas:GetServiceQuota") == [
        {"ServiceCode": "ec2", "QuotaCode": "L-2C3B7624" if instance_type.startswith("trn2") else "L-417A185B"}]
    deployment = f"qwen3-32b-{instance_type.split('.')[0]}"
    # each deployment's own profile, the one `neuron-disagg instance-profile --name DEPLOYMENT` creates
    assert all(p["IamInstanceProfile"] == {"Name": f"neuron-disagg-{deployment}"} for p in params)
    assert f"launch {deployment} in us-east-2:\n  2 x {instance_type}: $" in done.stderr
    assert [(p["Name"], p["Type"], p["Value"]) for p in calls(done.stdout, "ssm:PutParameter")] == [
        (f"/neuron-disagg/{deployment}/secret", "SecureString", "<redacted>")]
    assert "calls printed, none made" in done.stderr


def test_secret_in_user_data_is_the_explicit_way_without_an_instance_profile(tmp_path):
    env = clean_env(tmp_path, DRY_RUN="1", AWS_REGION="us-east-2", SUBNET_ID="subnet-0abc", SECRET_IN_USER_DATA="1")
    done = run("launch.sh", env, "trn2.48xlarge")
    assert done.returncode == 0, done.stderr
    assert calls(done.stdout, "ssm:PutParameter") == []
    assert all("redacted in dry run" in p["UserData"] and "IamInstanceProfile" not in p for p in launches(done.stdout))
    assert "WARNING: secret_in_user_data" in done.stderr


def test_xpyd_dry_run_launches_x_plus_y(tmp_path):
    done = run("launch.sh", clean_env(tmp_path, DRY_RUN="1", AWS_REGION="us-east-2", SUBNET_ID="subnet-0abc",
                                      CAPACITY_BLOCK="cr-0123"),
               "p5en.48xlarge", "2", "3")
    assert done.returncode == 0, done.stderr
    params = launches(done.stdout)
    assert [(p["InstanceType"], p["MinCount"]) for p in params] == [("p5en.48xlarge", 5)]  # one call, all or none
    assert all(p["InstanceMarketOptions"] == {"MarketType": "capacity-block"} for p in params)
    assert all(p["IamInstanceProfile"] == {"Name": "neuron-disagg-qwen3-32b-2p3d-p5en"} for p in params)
    assert [p["Name"] for p in calls(done.stdout, "ssm:PutParameter")] == ["/neuron-disagg/qwen3-32b-2p3d-p5en/secret"]
    for wrong in (("two",), ("p5en.48xlarge", "2"), ("p5en.48xlarge", "x", "3")):
        usage = run("launch.sh", clean_env(tmp_path), *wrong)
        assert usage.returncode == 2 and "usage: examples/launch.sh INSTANCE_TYPE [X Y]" in usage.stderr


@pytest.mark.parametrize("missing, message", [
    ({"AWS_REGION": ""}, "set AWS_REGION"),
    ({"SUBNET_ID": ""}, "set SUBNET_ID"),
    ({"AWS_ACCESS_KEY_ID": ""}, "no AWS credentials found"),
    ({"NEURON_DISAGG_SECRET": ""}, "set NEURON_DISAGG_SECRET"),
    ({"NEURON_DISAGG_VENV": "/nonexistent"}, "run scripts/setup.sh"),
])
def test_aws_examples_fail_early_with_a_clear_message(tmp_path, missing, message):
    env = clean_env(tmp_path, AWS_REGION="us-east-2", SUBNET_ID="subnet-0abc", AWS_ACCESS_KEY_ID="x",
                    AWS_SECRET_ACCESS_KEY="y", NEURON_DISAGG_SECRET="0123456789abcdef0123",
                    IAM_INSTANCE_PROFILE="neuron-disagg")
    env.update(missing)
    env = {k: v for k, v in env.items() if v != ""}
    done = run("launch.sh", env, "trn2.48xlarge")
    assert done.returncode == 1
    assert message in done.stderr and done.stdout == ""  # nothing launched, not even a dry run


def test_walk_through_creates_the_instance_profile_the_launch_message_names():
    """examples/README.md (step 2) gives exactly the commands launch's message gives for the walk-through's
    deployment: one role per deployment, reading that deployment's secret alone."""
    readme = (EXAMPLES / "README.md").read_text()
    message = missing_instance_profile_advice("/neuron-disagg/qwen3-32b-trn2/secret", "qwen3-32b-trn2")
    commands = [line.strip() for line in message.splitlines() if line.strip().startswith("aws iam ")]
    assert len(commands) == 5
    for command in commands:
        assert command in readme
    policy = json.loads(re.search(r"--policy-name neuron-disagg-secret --policy-document '([^']+)'", message).group(1))
    statements = {s["Action"]: s for s in policy["Statement"]}
    assert statements["ssm:GetParameter"]["Resource"] == "arn:aws:ssm:*:*:parameter/neuron-disagg/qwen3-32b-trn2/secret"
    assert "AmazonSSMManagedInstanceCore" not in message
    for family in ("trn2", "p5en"):  # each deployment of the walk-through gets its own
        assert f"neuron-disagg instance-profile examples/qwen3-32b.yaml --name qwen3-32b-{family}" in readme


def test_local_example_needs_the_venv(tmp_path):
    done = run("local_cpu_1p1d.sh", clean_env(tmp_path, NEURON_DISAGG_VENV="/nonexistent"))
    assert done.returncode == 1 and "run 'bash scripts/setup.sh' first" in done.stderr


def _ports(n: int) -> list[int]:
    """Ports below the ephemeral range (see local_cluster.free_port): the servers bind them up to a
    minute later, while vLLM and UCX draw ephemeral ports of their own."""
    from neuron_disagg.local_cluster import free_port

    return [free_port() for _ in range(n)]


@pytest.mark.integration
@pytest.mark.vllm_servers
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (scripts/setup.sh) is not installed")
def test_local_cpu_example_serves_a_request_through_the_router(tmp_path):
    p, d, r, p_side, d_side = _ports(5)
    env = {**os.environ, "P_PORT": str(p), "D_PORT": str(d), "ROUTER_PORT": str(r),
           "P_SIDE_CHANNEL_PORT": str(p_side), "D_SIDE_CHANNEL_PORT": str(d_side)}
    done = subprocess.run(["bash", str(EXAMPLES / "local_cpu_1p1d.sh")], env=env, capture_output=True, text=True,
                          timeout=540, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    answer = json.loads(done.stdout.split("answer: ", 1)[1].splitlines()[0])
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 16
    for port in (p, d, r):  # everything it started is gone
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
