from pathlib import Path

import pytest

from neuron_disagg.config import Config, ConfigError


def test_defaults_are_valid_and_push():
    config = Config()
    assert config.mode == "push" and config.side_channel == "127.0.0.1:5600"


@pytest.mark.parametrize("values,fragment", [
    ({"lease_s": 0}, "lease_s: Input should be greater than 0"),
    ({"side_channel_port": 80}, "side_channel_port: Input should be greater than or equal to 1024"),
    ({"mode": "teleport"}, "mode: Input should be 'push' or 'pull'"),
    ({"backend": "TCP"}, "backend: Input should be 'auto', 'UCX' or 'LIBFABRIC'"),
    ({"max_write_s": 1e9}, "max_write_s: Input should be less than or equal to 3600"),
    ({"leese_s": 3}, "leese_s: Extra inputs are not permitted"),
    ({"heartbeat_interval_s": 20, "lease_s": 30}, "at most half of lease_s"),
])
def test_invalid_values_name_the_field_and_the_range(values, fragment):
    with pytest.raises(ConfigError, match="invalid config") as err:
        Config.from_mapping(values)
    assert fragment in str(err.value)


def test_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mode: pull\nlease_s: 12\nheartbeat_interval_s: 2\n")
    config = Config.from_yaml(path)
    assert (config.mode, config.lease_s, config.heartbeat_interval_s) == ("pull", 12, 2)


def test_a_deployment_file_gives_its_connector_section(tmp_path):
    """examples/qwen3-32b.yaml configures `launch`, and through its neuron_disagg section `serve`,
    `router` and `ray-serve`: one file for a deployment, whatever runs it."""
    example = Path(__file__).resolve().parents[2] / "examples" / "qwen3-32b.yaml"
    assert Config.from_yaml(example).mode == "push"
    path = tmp_path / "deployment.yaml"
    path.write_text("name: x\nmodel: m\nneuron_disagg:\n  mode: pull\n  lease_s: -1\n")
    with pytest.raises(ConfigError, match="neuron_disagg") as err:
        Config.from_yaml(path)
    assert "lease_s" in str(err.value)


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("lease_s: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Config.from_yaml(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        Config.from_yaml(path)
    path.write_text("watchdog_s: -3\n")
    with pytest.raises(ConfigError, match=f"config file {path}"):
        Config.from_yaml(path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        Config.from_yaml(tmp_path / "missing.yaml")


def test_secret_from_environment(monkeypatch):
    monkeypatch.setenv("MY_SECRET", "s" * 32)
    assert Config(secret_env="MY_SECRET").load_secret() == b"s" * 32


def test_secret_from_file_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", "e" * 32)
    path = tmp_path / "secret"
    path.write_text("f" * 40 + "\n")
    assert Config(secret_file=path).load_secret() == b"f" * 40


def test_missing_or_short_secret_fails_with_advice(monkeypatch):
    monkeypatch.delenv("NEURON_DISAGG_SECRET", raising=False)
    with pytest.raises(ConfigError, match="environment variable NEURON_DISAGG_SECRET.*openssl rand"):
        Config().load_secret()
    monkeypatch.setenv("NEURON_DISAGG_SECRET", "short")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        Config().load_secret()


def test_secret_is_never_part_of_the_config_dump(monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", "topsecret-value-0123456789")
    config = Config()
    config.load_secret()
    assert "topsecret" not in repr(config) and "topsecret" not in config.model_dump_json()


def test_timeouts_are_derived_from_the_config():
    config = Config(lease_s=10, heartbeat_interval_s=1, watchdog_s=7, max_write_s=3)
    assert config.producer_timeouts().lease_s == 10
    assert config.consumer_timeouts().watchdog_s == 7
    assert config.consumer_timeouts().max_write_s == 3
