"""A launch or a boot that fails leaves nothing billing, and says which
instances it ended and why. Against moto as a server; what moto cannot do (CreateTags answering
InvalidInstanceID.NotFound, a RunInstances answer lost after the instances exist, an instance's
console text) comes from ``MotoGaps`` (conftest.py)."""

from __future__ import annotations

import io

import pytest
from botocore.exceptions import ReadTimeoutError

from neuron_disagg.deploy import launch as launch_module
from neuron_disagg.deploy.errors import AwsCallFailed
from neuron_disagg.deploy.launch import launch
from neuron_disagg.deploy.status import print_status, status
from neuron_disagg.deploy.user_data import FATAL_PREFIX

from .test_launch import deployment, instances_of, tags

NOT_FOUND = ("InvalidInstanceID.NotFound", "The instance ID 'i-0123' does not exist")


@pytest.fixture
def waits(cloud, monkeypatch) -> list[float]:
    """The cloud's waits, recorded instead of slept."""
    waited: list[float] = []
    monkeypatch.setattr(cloud, "wait", waited.append)
    return waited


def test_instances_terminate_when_they_shut_themselves_down(cloud, network, baked_ami, gaps, ec2, tmp_path):
    launch(cloud, deployment(tmp_path, network))
    (wire,) = gaps.run_instances_wire
    assert wire["InstanceInitiatedShutdownBehavior"] == "terminate"
    for instance in instances_of(ec2):
        assert ec2.describe_instance_attribute(InstanceId=instance["InstanceId"], Attribute=(
            "instanceInitiatedShutdownBehavior"))["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"


def test_tagging_is_retried_while_ec2_does_not_know_the_new_instances_yet(cloud, network, baked_ami, gaps, ec2,
                                                                          tmp_path, waits):
    gaps.create_tags_failures = [NOT_FOUND, NOT_FOUND]
    launch(cloud, deployment(tmp_path, network))
    assert waits == [1.0, 2.0]
    assert {tags(i)["neuron-disagg:role"] for i in instances_of(ec2)} == {"prefill", "decode"}


def test_tagging_that_never_sees_the_instances_gives_up_and_terminates_them(cloud, network, baked_ami, gaps, ec2,
                                                                            tmp_path, waits):
    gaps.create_tags_failures = [NOT_FOUND] * 10
    with pytest.raises(AwsCallFailed, match="InvalidInstanceID.NotFound") as err:
        launch(cloud, deployment(tmp_path, network))
    assert waits == list(launch_module.TAG_RETRY_DELAYS_S)  # bounded: about a minute
    assert instances_of(ec2) == []
    assert "terminated the 2 instance(s) this launch had started: i-" in str(err.value)


def test_a_tagging_failure_terminates_the_instances_and_names_them(cloud, network, baked_ami, gaps, ec2, tmp_path):
    launched = []
    gaps.create_tags_failures = [("InvalidParameterValue", "Tag value exceeds the maximum length")]
    with pytest.raises(AwsCallFailed, match="InvalidParameterValue") as err:
        launch(cloud, deployment(tmp_path, network))
    launched = [i["InstanceId"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]
    assert len(launched) == 2 and instances_of(ec2) == []
    assert all(i in str(err.value) for i in launched)


def test_an_answer_lost_after_the_instances_started_still_terminates_them(cloud, network, baked_ami, gaps, ec2,
                                                                          tmp_path):
    """RunInstances tags the instances as it creates them: cleanup finds them by the deployment's tag."""
    gaps.raise_after_run_instances = ReadTimeoutError(endpoint_url="https://ec2.us-east-2.amazonaws.com")
    with pytest.raises(ReadTimeoutError):
        launch(cloud, deployment(tmp_path, network))
    assert instances_of(ec2) == []
    assert "launch stopped by ReadTimeoutError: terminated the 2 instance(s)" in cloud.log.getvalue()


def test_a_cleanup_that_fails_names_every_instance_still_billing(cloud, network, baked_ami, gaps, ec2, tmp_path,
                                                                 monkeypatch):
    call = cloud.call

    def no_terminate(service, operation, **params):
        if operation == "TerminateInstances":
            raise AwsCallFailed(operation, "UnauthorizedOperation", "not allowed")
        return call(service, operation, **params)

    monkeypatch.setattr(cloud, "call", no_terminate)
    gaps.create_tags_failures = [("InvalidParameterValue", "Tag value exceeds the maximum length")]
    with pytest.raises(AwsCallFailed, match="InvalidParameterValue") as err:  # the cause still reaches the user
        launch(cloud, deployment(tmp_path, network))
    running = [i["InstanceId"] for i in instances_of(ec2)]
    assert len(running) == 2
    said = str(err.value)
    assert "FAILED" in said and "may still run and bill" in said and "neuron-disagg teardown" in said
    assert all(i in said for i in running)


def test_status_says_why_a_boot_gave_up_and_keeps_the_terminated_instance_in_view(cloud, network, baked_ami, gaps,
                                                                                  ec2, tmp_path):
    launch(cloud, deployment(tmp_path, network))
    by_role = {tags(i)["neuron-disagg:role"]: i["InstanceId"] for i in instances_of(ec2)}
    gaps.console[by_role["decode"]] = ("[  OK  ] Started cloud-final.service\n"
                                       f"{FATAL_PREFIX} could not read the deployment secret from SecureString "
                                       "/neuron-disagg/t1/secret\n")
    ec2.terminate_instances(InstanceIds=[by_role["decode"]])  # what its shutdown does, with terminate behaviour

    rows = {r["role"]: r for r in status(cloud, "t1")}
    assert rows["decode"]["state"] == "terminated"
    assert rows["decode"]["reason"] == ("gave up: could not read the deployment secret from SecureString "
                                        "/neuron-disagg/t1/secret")
    assert "reason" not in rows["prefill"]
    out = io.StringIO()
    print_status(list(rows.values()), "t1", 8000, out)
    assert f"t1-decode-0 ({by_role['decode']}) terminated: gave up: could not read" in out.getvalue()

    ec2.terminate_instances(InstanceIds=[by_role["prefill"]])  # ended by someone: moto's sample console
    assert [r["role"] for r in status(cloud, "t1")] == ["decode"]
    assert [r["role"] for r in status(cloud, "t1", include_terminated=True)] == ["decode", "prefill"]
