"""`neuron-disagg ray-serve` refuses at once, saying what to change, what would only fail later in
a replica: a bad config, the secret missing or passed through Ray's config, bad flags, no Ray."""

from __future__ import annotations

import importlib.util

import pytest

from neuron_disagg.ray_serve import app

MODEL = "/models/tiny"
SECRET = "x" * 32


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", SECRET)


@pytest.mark.parametrize("argv, words", [
    (["--modes", "push,teleport"], "--modes takes push and/or pull"),
    (["--modes", "push,push"], "--modes takes push and/or pull"),
    (["--engine-kwargs", "{not json"], "--engine-kwargs is not valid JSON"),
    (["--deployment-config", "[1]"], "--deployment-config must be a JSON object"),
    (["--prefill-env", "NOEQUALS"], "--prefill-env takes KEY=VALUE"),
    (["--decode-env", f"NEURON_DISAGG_SECRET={SECRET}"], "comes from each node's environment"),
])
def test_bad_flags_are_refused_before_ray_starts(secret, capsys, argv, words):
    assert app.main([MODEL, *argv]) == 2
    assert words in capsys.readouterr().err


def test_a_missing_secret_is_refused_before_ray_starts(monkeypatch, capsys):
    monkeypatch.delenv("NEURON_DISAGG_SECRET", raising=False)
    assert app.main([MODEL]) == 2
    assert "NEURON_DISAGG_SECRET" in capsys.readouterr().err


def test_a_bad_config_file_is_refused_naming_the_field(secret, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("lease_s: -1\n")
    assert app.main([MODEL, "--config", str(config)]) == 2
    assert "lease_s" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed in this environment")
def test_without_ray_it_says_what_to_install(secret, capsys):
    assert app.main([MODEL]) == 2
    assert "ray[serve]==2.60.0" in capsys.readouterr().err


def test_each_roles_ray_config_carries_the_connector_config_serve_would_give_vllm():
    from neuron_disagg.config import Config

    config = Config(mode="pull", side_channel_host="127.0.0.1", lease_s=12)
    prefill = app.llm_config("prefill", MODEL, "tiny", config, replicas=2, engine_kwargs={"max_model_len": 64},
                             env={"A": "1"}, deployment_config={}, cpu_only=True)
    transfer = prefill["engine_kwargs"]["kv_transfer_config"]
    assert transfer["kv_role"] == "kv_producer" and transfer["kv_connector"] == app.CONNECTOR
    # a value written at its default is kept: the backend reads it as "this host, not the node's"
    assert transfer["kv_connector_extra_config"] == {"mode": "pull", "side_channel_host": "127.0.0.1", "lease_s": 12.0}
    assert prefill["deployment_config"] == {"num_replicas": 2} and prefill["runtime_env"] == {"env_vars": {"A": "1"}}
    assert prefill["placement_group_config"] == {"bundles": [{"CPU": 1}]}


def test_autoscaling_takes_the_place_of_a_fixed_replica_count():
    from neuron_disagg.config import Config

    scaling = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}
    decode = app.llm_config("decode", MODEL, "tiny", Config(), replicas=2, engine_kwargs={}, env={},
                            deployment_config=scaling, cpu_only=False)
    assert decode["deployment_config"] == scaling and "placement_group_config" not in decode
