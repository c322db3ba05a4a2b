"""One config, sized per platform: how a trn2.48xlarge and a p5en.48xlarge host are cut into vLLM
instances (TP per instance, instances per host), from the accelerators AWS says each type has (moto
carries AWS's DescribeInstanceTypes data), with defaults that fill the host."""

from __future__ import annotations

import pytest

from neuron_disagg.deploy import sizing
from neuron_disagg.deploy.errors import DeploymentConfigError
from neuron_disagg.deploy.instance_types import DRY_RUN_ACCELERATORS, InstanceTypeInfo
from neuron_disagg.deploy.settings import DeploymentConfig

from .conftest import write_config

EXAMPLE = "examples/qwen3-32b.yaml"


@pytest.fixture
def types(ec2) -> dict[str, InstanceTypeInfo]:
    wanted = ["trn2.48xlarge", "p5en.48xlarge", "trn1.32xlarge", "p5.48xlarge"]
    items = ec2.describe_instance_types(InstanceTypes=wanted)["InstanceTypes"]
    return {item["InstanceType"]: InstanceTypeInfo.from_api(item) for item in items}


def example(instance_type: str) -> DeploymentConfig:
    return DeploymentConfig.from_yaml(EXAMPLE, {"prefill.instance_type": instance_type,
                                                "decode.instance_type": instance_type})


def test_aws_says_a_trn2_has_64_logical_neuroncores_and_a_p5en_8_gpus(types):
    """16 Trainium2 chips of 8 NeuronCore-v3 (128 physical) at the default LNC=2; 8 H200."""
    assert types["trn2.48xlarge"].accelerators == 64 and types["trn2.48xlarge"].vcpus == 192
    assert types["p5en.48xlarge"].accelerators == 8 and types["p5en.48xlarge"].vcpus == 192
    assert types["trn1.32xlarge"].accelerators == 32  # NeuronCore-v2: one logical core each
    for name, info in types.items():  # the dry run's table agrees with AWS
        assert DRY_RUN_ACCELERATORS[name] == info.accelerators


@pytest.mark.parametrize("instance_type, tp, instances", [("trn2.48xlarge", 8, 8), ("p5en.48xlarge", 8, 1)])
def test_the_example_config_uses_the_whole_host_on_either_platform(types, instance_type, tp, instances):
    config = example(instance_type)
    for role in ("prefill", "decode"):
        host = sizing.plan(config, role, types[instance_type])
        assert (host.tensor_parallel_size, host.instances, host.idle) == (tp, instances, 0)


@pytest.mark.parametrize("hosts, trn2, p5en", [
    ({}, (64, 1), (8, 1)),  # nothing set: one instance on every accelerator
    ({"neuron": {"tensor_parallel_size": 16}}, (16, 4), (8, 1)),  # TP set: as many as fit
    ({"neuron": {"instances_per_host": 2}, "cuda": {"instances_per_host": 2}}, (32, 2), (4, 2)),  # count set
    ({"neuron": {"tensor_parallel_size": 16, "instances_per_host": 2}}, (16, 2), (8, 1)),  # both: as said
])
def test_what_the_config_leaves_unset_fills_the_host(tmp_path, types, hosts, trn2, p5en):
    config = DeploymentConfig.from_yaml(write_config(tmp_path, hosts=hosts))
    for instance_type, expected in (("trn2.48xlarge", trn2), ("p5en.48xlarge", p5en)):
        host = sizing.plan(config, "prefill", types[instance_type])
        assert (host.tensor_parallel_size, host.instances) == expected, instance_type


def test_a_use_that_overfills_the_host_is_refused_naming_the_keys(tmp_path, types):
    config = DeploymentConfig.from_yaml(write_config(tmp_path, hosts={"cuda": {"tensor_parallel_size": 16}}))
    with pytest.raises(DeploymentConfigError) as err:
        sizing.plan(config, "decode", types["p5en.48xlarge"])
    for said in ("hosts.cuda", "TP 16 need 16 accelerators", "p5en.48xlarge has 8", "lower hosts.cuda.tensor_parallel_size"):
        assert said in str(err.value), said
    config = DeploymentConfig.from_yaml(write_config(tmp_path, hosts={"neuron": {"tensor_parallel_size": 8,
                                                                                 "instances_per_host": 9}}))
    with pytest.raises(DeploymentConfigError, match="logical NeuronCores at the default LNC=2"):
        sizing.plan(config, "decode", types["trn2.48xlarge"])


def test_one_tp_for_every_platform_is_refused_for_the_per_platform_keys(tmp_path):
    with pytest.raises(DeploymentConfigError) as err:
        DeploymentConfig.from_yaml(write_config(tmp_path, tensor_parallel_size=8))
    assert "hosts.neuron.tensor_parallel_size" in str(err.value) and "(got" not in str(err.value)


def test_the_routers_port_may_not_be_one_of_its_hosts_instances(tmp_path, types):
    config = DeploymentConfig.from_yaml(write_config(tmp_path, router={"host": "prefill", "port": 8103}))
    with pytest.raises(DeploymentConfigError, match="router's port 8103 is one of the prefill instances' ports 8100-8107"):
        sizing.plans(config, types)


def test_the_serving_deadline_is_the_platforms_warm_up_and_a_margin(tmp_path):
    config = DeploymentConfig.from_yaml(write_config(tmp_path))
    assert sizing.serving_deadline_s(config, "neuron") == (60 + 60) * 60  # compilation on Trainium
    assert sizing.serving_deadline_s(config, "cuda") == (20 + 60) * 60
    config = DeploymentConfig.from_yaml(write_config(tmp_path, serving_deadline_minutes=45))
    assert sizing.serving_deadline_s(config, "neuron") == 45 * 60
