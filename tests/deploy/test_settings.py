"""The deployment config: strict validation before any AWS call, flags over the file, and the
neuron-disagg Config each instance gets."""

from __future__ import annotations

import pytest

from neuron_disagg.config import Config
from neuron_disagg.deploy.errors import DeploymentConfigError
from neuron_disagg.deploy.settings import INSTANCE_SECRET_FILE, DeploymentConfig

from .conftest import write_config


def test_example_config_validates_for_both_platforms():
    for instance_type in ("trn2.48xlarge", "p5en.48xlarge"):
        config = DeploymentConfig.from_yaml("examples/qwen3-32b.yaml", {
            "prefill.instance_type": instance_type, "decode.instance_type": instance_type,
            "region": "us-east-2", "subnet_id": "subnet-0123abcd", "iam_instance_profile": "neuron-disagg"})
        config.require_launchable()
        assert config.model == "Qwen/Qwen3-32B" and config.max_hours == 8
        assert config.hosts.neuron.tensor_parallel_size == config.hosts.cuda.tensor_parallel_size == 8
        assert config.neuron_disagg.mode == "push"
        assert config.prefill.instance_type == config.decode.instance_type == instance_type


def test_unknown_keys_and_bad_values_name_the_field(tmp_path):
    with pytest.raises(DeploymentConfigError) as err:
        DeploymentConfig.from_yaml(write_config(tmp_path, replicas=3, prefill={"count": 0}))
    message = str(err.value)
    assert "replicas" in message and "prefill.count" in message


def test_embedded_neuron_disagg_config_is_validated_by_config(tmp_path):
    with pytest.raises(DeploymentConfigError, match="neuron_disagg: .*heartbeat_interval_s"):
        DeploymentConfig.from_yaml(write_config(tmp_path, neuron_disagg={"lease_s": 4, "heartbeat_interval_s": 3}))
    with pytest.raises(DeploymentConfigError, match="neuron_disagg.bogus"):
        DeploymentConfig.from_yaml(write_config(tmp_path, neuron_disagg={"bogus": 1}))


def test_missing_launch_fields_are_listed_with_their_flags(tmp_path):
    config = DeploymentConfig.from_yaml(write_config(tmp_path, region=None, prefill={"count": 1}))
    with pytest.raises(DeploymentConfigError) as err:
        config.require_launchable()
    message = str(err.value)
    for expected in ("region (or --region)", "subnet_id (or --subnet)", "prefill.instance_type (or --instance-type)"):
        assert expected in message


def test_flags_override_the_file(tmp_path):
    config = DeploymentConfig.from_yaml(write_config(tmp_path), {
        "prefill.instance_type": "p5en.48xlarge", "decode.count": 3, "name": None})
    assert config.prefill.instance_type == "p5en.48xlarge" and config.decode.count == 3
    assert config.name == "t1"  # None means "flag not given"


def test_vllm_args_must_be_plain_words(tmp_path):
    with pytest.raises(DeploymentConfigError, match="one word"):
        DeploymentConfig.from_yaml(write_config(tmp_path, vllm_args=["--x", "a b"]))
    with pytest.raises(DeploymentConfigError, match="vllm_args"):
        DeploymentConfig.from_yaml(write_config(tmp_path, vllm_args=["$(reboot)"]))


def test_reserved_tags(tmp_path):
    with pytest.raises(DeploymentConfigError, match="reserved"):
        DeploymentConfig.from_yaml(write_config(tmp_path, tags={"neuron-disagg:role": "x"}))


@pytest.mark.parametrize("key", ["team/owner", "cost center", "_index"])
def test_tag_keys_instance_metadata_cannot_carry_are_refused_before_launch(tmp_path, key):
    """The instances expose their tags in instance metadata (the router's host reads its peers there),
    and EC2 refuses a launch with such a tag key: said here instead, naming what is allowed."""
    with pytest.raises(DeploymentConfigError, match="no spaces or /"):
        DeploymentConfig.from_yaml(write_config(tmp_path, tags={key: "x"}))
    assert DeploymentConfig.from_yaml(write_config(tmp_path, tags={"team:owner@x": "a/b c"})).tags


def test_secret_parameter_is_named_after_the_deployment_unless_set(tmp_path):
    assert DeploymentConfig.from_yaml(write_config(tmp_path, name="prod-1")).secret_parameter == (
        "/neuron-disagg/prod-1/secret")
    assert DeploymentConfig.from_yaml(write_config(tmp_path, secret_ssm_parameter="/team/nd")).secret_parameter == (
        "/team/nd")
    with pytest.raises(DeploymentConfigError, match="reserved by AWS"):
        DeploymentConfig.from_yaml(write_config(tmp_path, secret_ssm_parameter="/aws/service/x"))


def test_only_launch_needs_an_instance_profile_and_only_for_the_ssm_secret(tmp_path):
    config = DeploymentConfig.from_yaml(write_config(tmp_path, {"subnet_id": "subnet-0abc"}, iam_instance_profile=None))
    config.require("region")  # status and teardown: fine without one
    with pytest.raises(DeploymentConfigError, match="no iam_instance_profile"):
        config.require_launchable()
    config.model_copy(update={"secret_in_user_data": True}).require_launchable()
    config.model_copy(update={"iam_instance_profile": "nd"}).require_launchable()


def test_instance_config_points_at_the_root_only_secret_file(tmp_path):
    config = DeploymentConfig.from_yaml(write_config(tmp_path, neuron_disagg={"lease_s": 40, "secret_env": "X"}))
    values = config.instance_config()
    assert values["secret_file"] == INSTANCE_SECRET_FILE and values["lease_s"] == 40
    assert "secret_env" not in values
    Config.from_mapping(values)  # what the instance will load
