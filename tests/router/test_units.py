"""The router's pure parts, without servers: specs, ids, selection, metrics parsing, validation,
and flag handling."""

from __future__ import annotations

import pytest

from neuron_disagg.config import ConfigError
from neuron_disagg.protocol.messages import TransferId
from neuron_disagg.router import cli
from neuron_disagg.router.health import parse_engine_load
from neuron_disagg.kv_params import format_transfer_id, parse_transfer_id
from neuron_disagg.router.instances import EngineLoad, InstanceSpecError, make_instance, parse_instance_spec
from neuron_disagg.router.requests import parse_client_request
from neuron_disagg.router.selection import pick_decode, pick_prefill


def test_instance_specs():
    p = parse_instance_spec("prefill", "http://10.0.0.5:8100/", 5600)
    assert (p.url, p.side_channel, p.tp) == ("http://10.0.0.5:8100", "10.0.0.5:5600", 1)
    p = parse_instance_spec("prefill", "http://h:8100, side_channel=h2:7000 ,tp=8", 5600)
    assert (p.side_channel, p.tp, p.engine_id) == ("h2:7000", 8, None)
    assert parse_instance_spec("prefill", "http://h:8100,engine_id=ref-p", 5600).engine_id == "ref-p"
    assert parse_instance_spec("decode", "http://[::1]:8200", 6000).side_channel == "[::1]:6000"
    for bad, words in (("10.0.0.5:8100", "http:// or https://"), ("http://h:1,tp=0", "tp must be"),
                       ("http://h:1,side_channel=h", "HOST:PORT"), ("http://h:1,zone=a", "bad option"),
                       ("http://h:1,tp=2,tp=3", "bad option"), ("http://h:1,side_channel=h:99999", "1..65535")):
        with pytest.raises(InstanceSpecError, match=words):
            parse_instance_spec("prefill", bad, 5600)


def test_transfer_ids_round_trip_from_the_router_to_the_connector():
    assert format_transfer_id("req.1", 2) == "req.1#2"
    assert parse_transfer_id("a#b#3") == TransferId("a#b", 3)
    for bad in ("abc", "#1", "abc#", "abc#x"):
        with pytest.raises(ValueError, match="<request>#<attempt>"):
            parse_transfer_id(bad)


def _insts(role, n):
    return [make_instance(role, f"http://h{i}:1", None, None, 5600) for i in range(n)]


def test_prefill_choice_by_outstanding_prompt_tokens_then_turns():
    a, b, c = _insts("prefill", 3)
    a.prompt_tokens, b.prompt_tokens, c.prompt_tokens = 500, 20, 20
    b.last_picked, c.last_picked = 5, 3
    assert pick_prefill([a, b, c]) is c
    c.in_flight = 1
    assert pick_prefill([a, b, c]) is b


def test_decode_choice_uses_fresh_engine_metrics_and_kv_usage():
    a, b = _insts("decode", 2)
    a.in_flight, b.in_flight = 1, 2
    assert pick_decode([a, b], now=100.0, metrics_stale_s=30, kv_cache_full_fraction=0.95) is a
    a.engine = EngineLoad(running=10, waiting=5, kv_cache_usage=0.2, at=90.0)
    assert pick_decode([a, b], now=100.0, metrics_stale_s=30, kv_cache_full_fraction=0.95) is b
    assert pick_decode([a, b], now=200.0, metrics_stale_s=30, kv_cache_full_fraction=0.95) is a  # stale
    a.engine, b.engine = None, EngineLoad(0, 0, 0.97, at=100.0)
    assert pick_decode([a, b], now=100.0, metrics_stale_s=30, kv_cache_full_fraction=0.95) is a


def test_vllm_metrics_parsing():
    text = ('# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 4.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 2.0\n'
            '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n')
    load = parse_engine_load(text, now=7.0)
    assert (load.running, load.waiting, load.kv_cache_usage, load.at) == (7.0, 2.0, 0.5, 7.0)
    assert parse_engine_load("# TYPE other gauge\nother 1\n", 0.0) is None
    assert parse_engine_load("not { prometheus", 0.0) is None


def test_prompt_token_estimates():
    def tokens(path, body):
        import json
        return parse_client_request(path, json.dumps(body).encode(), "push").prompt_tokens
    assert tokens("/v1/completions", {"model": "m", "prompt": "x" * 400}) == 100
    assert tokens("/v1/completions", {"model": "m", "prompt": [[1, 2, 3], [4]]}) == 4
    assert tokens("/v1/completions", {"model": "m", "prompt": ["x" * 40, "y" * 8]}) == 12
    assert tokens("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "z" * 80}, {"type": "image_url"}]}]}) == 24


def test_cli_builds_settings_from_flags_config_and_environment(tmp_path, monkeypatch):
    config = tmp_path / "deploy.yaml"
    config.write_text("mode: pull\nside_channel_port: 6100\n")
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    monkeypatch.setenv("NEURON_DISAGG_SECRET", "x" * 32)
    settings, instances, _, signer, args = cli.build([
        "--config", str(config), "--prefill", "http://10.0.0.1:8100,tp=2", "--decode",
        "http://10.0.0.2:8200", "--port", "0", "--prefill-timeout-s", "12.5", "--prefill-retries", "0"])
    assert settings.mode == "pull" and settings.api_key == "from-env"
    assert settings.prefill_timeout_s == 12.5 and settings.prefill_retries == 0
    assert [(i.role, i.side_channel, i.tp) for i in instances] == [
        ("prefill", "10.0.0.1:6100", 2), ("decode", "10.0.0.2:6100", 1)]
    assert signer is not None and "x" * 32 not in repr(signer)
    settings, _, _, _, _ = cli.build(["--config", str(config), "--mode", "push", "--api-key", "flag"])
    assert settings.mode == "push" and settings.api_key == "flag"
    assert "flag" not in repr(settings)


def test_cli_needs_the_deployment_secret_for_our_modes_only(monkeypatch):
    """Our connector acts only on signed kv_transfer_params: a push or pull router without the
    secret would send requests every instance serves without disaggregation. It fails at startup."""
    monkeypatch.delenv("NEURON_DISAGG_SECRET", raising=False)
    for mode in ("push", "pull"):
        with pytest.raises(ConfigError, match="NEURON_DISAGG_SECRET"):
            cli.build(["--mode", mode])
    *_, signer, _ = cli.build(["--mode", "vllm-pull"])
    assert signer is None


@pytest.mark.parametrize("argv, words", [
    (["--prefill", "10.0.0.1:8100"], "http:// or https://"),
    (["--decode", "http://h:1", "--decode", "http://h:1/"], "more than once"),
    (["--health-interval-s", "-1"], "health_interval_s"),
    (["--config", "/nonexistent/x.yaml"], "cannot read config file"),
    (["--mode", "vllm-push", "--prefill", "http://h:1,side_channel=h:5600"], "engine_id=ID on every --prefill"),
    (["--prefill", "http://h:1,engine_id="], "engine_id must be a non-empty string"),
])
def test_cli_rejects_bad_input_with_status_2(argv, words, capsys):
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err


def test_settings_errors_name_the_field():
    from neuron_disagg.router.settings import RouterSettings
    with pytest.raises(ConfigError, match="decode_first_byte_timeout_s"):
        RouterSettings.build(decode_first_byte_timeout_s=0)
