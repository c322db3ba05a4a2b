"""The router's HTTP contract: validation, auth, request ids, passthrough, /metrics."""

from __future__ import annotations

import re

import pytest

from .conftest import cluster, completion

_ANY = {"model": "fake-model", "prompt": "x"}


@pytest.mark.parametrize("path, raw, code, words", [
    ("/v1/completions", b"{not json", "invalid_json", "not valid JSON"),
    ("/v1/completions", b"[1, 2]", "invalid_json", "must be a JSON object"),
    ("/v1/completions", b'{"prompt": "hi"}', "missing_model", "'model' is required"),
    ("/v1/completions", b'{"model": "m"}', "missing_prompt", "'prompt' is required"),
    ("/v1/completions", b'{"model": "m", "prompt": ""}', "missing_prompt", "must not be empty"),
    ("/v1/completions", b'{"model": "m", "prompt": [1, "a"]}', "invalid_prompt", "list of token ids"),
    ("/v1/completions", b'{"model": "m", "prompt": "a", "stream": "yes"}', "invalid_stream", "true or false"),
    ("/v1/completions", b'{"model": "m", "prompt": "a", "disagg_mode": "teleport"}',
     "invalid_disagg_mode", "push, pull, vllm-push, vllm-pull"),
    ("/v1/chat/completions", b'{"model": "m"}', "missing_messages", "'messages' is required"),
    ("/v1/chat/completions", b'{"model": "m", "messages": ["hi"]}', "invalid_messages", "messages[0]"),
])
async def test_malformed_requests_are_400_with_a_clear_message(path, raw, code, words):
    async with cluster() as c:
        status, headers, answer = await c.post(path, None, raw=raw)
        assert status == 400, answer
        assert answer["error"]["code"] == code and answer["error"]["type"] == "invalid_request_error"
        assert words in answer["error"]["message"]
        assert headers["X-Request-Id"]
        assert not c.prefills[0].requests and not c.decodes[0].requests


async def test_oversized_body_is_413_and_unknown_route_is_404():
    async with cluster(max_body_bytes=4096) as c:
        status, _, answer = await c.post("/v1/completions", completion("y" * 8000))
        assert status == 413 and answer["error"]["code"] == "body_too_large"
        assert "4096" in answer["error"]["message"]
        status, headers, answer = await c.post("/v1/embeddings", _ANY)
        assert status == 404 and answer["error"]["type"] == "not_found_error"
        assert headers["X-Request-Id"]
        async with c.client.get(c.url + "/v1/completions") as resp:
            assert resp.status == 405 and (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_request_id_is_taken_from_the_client_or_generated():
    async with cluster() as c:
        status, headers, _ = await c.post("/v1/completions", completion(), {"X-Request-Id": "abc-123"})
        assert status == 200 and headers["X-Request-Id"] == "abc-123"
        tid = c.prefills[0].requests[0].transfer_id
        # The client's id, made unique per request (a client may reuse ids), then the attempt.
        assert re.fullmatch(r"abc-123\.[0-9a-f]{8}#0", tid)
        status, headers, _ = await c.post("/v1/completions", completion(), {"X-Request-Id": "abc-123"})
        assert c.prefills[0].requests[1].transfer_id != tid
        for bad in (None, "has space", "a#1", "x" * 200):
            status, headers, _ = await c.post("/v1/completions", completion(),
                                              {"X-Request-Id": bad} if bad else {})
            assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])
        status, headers, _ = await c.post("/v1/completions", {"prompt": 1}, {"X-Request-Id": "bad-one"})
        assert status == 400 and headers["X-Request-Id"] == "bad-one"


async def test_request_id_is_in_every_log_line(caplog):
    async with cluster(prefill=2) as c:
        c.prefills[0].fail_status = 500
        with caplog.at_level("DEBUG", logger="neuron_disagg.router"):
            status, _, _ = await c.post("/v1/completions", completion(), {"X-Request-Id": "trace-me"})
        assert status == 200
        lines = [r.getMessage() for r in caplog.records if r.name == "neuron_disagg.router"]
        assert lines and all(line.startswith("[trace-me] ") for line in lines), lines
        assert any("retrying on another P" in line for line in lines)


async def test_client_authorization_is_passed_to_every_instance():
    async with cluster() as c:
        auth = {"Authorization": "Bearer upstream-key"}
        assert (await c.post("/v1/completions", completion(), auth))[0] == 200
        assert (await c.post("/tokenize", {"model": "fake-model", "prompt": "a b c"}, auth))[0] == 200
        assert c.prefills[0].requests[0].headers["Authorization"] == "Bearer upstream-key"
        assert c.decodes[0].requests[0].headers["Authorization"] == "Bearer upstream-key"
        assert c.decodes[0].other[0][1]["Authorization"] == "Bearer upstream-key"


async def test_router_api_key():
    async with cluster(api_key="s3cret") as c:
        status, headers, answer = await c.post("/v1/completions", completion())
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        assert "missing API key" in answer["error"]["message"] and headers["X-Request-Id"]
        status, _, answer = await c.post("/v1/completions", completion(), {"Authorization": "Bearer nope"})
        assert status == 401 and "wrong API key" in answer["error"]["message"]
        assert (await c.admin("DELETE", {"url": c.decodes[0].url}))[0] == 401
        assert (await c.admin("GET"))[0] == 401
        async with c.client.get(c.url + "/v1/models") as resp:
            assert resp.status == 401
        assert not c.prefills[0].requests and not c.decodes[0].requests
        good = {"Authorization": "Bearer s3cret"}
        assert (await c.post("/v1/completions", completion(), good))[0] == 200
        assert c.decodes[0].requests[0].headers["Authorization"] == "Bearer s3cret"
        async with c.client.get(c.url + "/health") as resp:  # probes need no key
            assert resp.status == 200


async def test_models_tokenize_detokenize_come_from_a_healthy_decode():
    async with cluster(decode=2) as c:
        c.router.pool.set_health(c.instance(c.decodes[0]), False)
        async with c.client.get(c.url + "/v1/models") as resp:
            assert resp.status == 200 and (await resp.json())["data"][0]["owned_by"] == "d1"
        status, _, answer = await c.post("/tokenize", {"model": "fake-model", "prompt": "a b c"})
        assert status == 200 and answer == {"tokens": [0, 1, 2], "count": 3, "served_by": "d1"}
        status, _, answer = await c.post("/detokenize", {"model": "fake-model", "tokens": [7, 8]})
        assert status == 200 and answer["prompt"] == "7 8"
        assert not c.decodes[0].other and [p for p, _ in c.decodes[1].other] == [
            "/v1/models", "/tokenize", "/detokenize"]


async def test_metrics_endpoint():
    async with cluster(prefill=2) as c:
        c.prefills[0].fail_status = 500
        assert (await c.post("/v1/completions", completion()))[0] == 200
        c.prefills[0].fail_status = None
        assert len(await c.stream(completion(disagg_mode="pull"))) == 4
        await c.post("/v1/completions", None, raw=b"{")
        async with c.client.get(c.url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        for line in (
            'neuron_disagg_router_requests_total{mode="push",outcome="ok"} 1.0',
            'neuron_disagg_router_requests_total{mode="pull",outcome="ok"} 1.0',
            'neuron_disagg_router_requests_total{mode="none",outcome="invalid"} 1.0',
            'neuron_disagg_router_retries_total{mode="push",reason="prefill_error"} 1.0',
            'neuron_disagg_router_failures_total{reason="prefill_error"} 1.0',
            'neuron_disagg_router_ttft_seconds_count{mode="pull"} 1.0',
            'neuron_disagg_router_request_duration_seconds_count{mode="push"} 1.0',
            f'neuron_disagg_router_instance_in_flight{{role="decode",url="{c.decodes[0].url}"}} 0.0',
            f'neuron_disagg_router_instance_prompt_tokens{{url="{c.prefills[1].url}"}} 0.0',
        ):
            assert line in text, line
