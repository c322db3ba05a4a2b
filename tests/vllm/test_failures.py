"""Why a request's KV did not arrive reaches its client: the reason travels with the connector's
stats into the API server process, and the middleware `serve` installs puts it into vLLM's generic
"Internal server error" (a 500 answer or a stream's error event) for the request the router named."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from fastapi import FastAPI  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from neuron_disagg.protocol import TransferId  # noqa: E402
from neuron_disagg.vllm import failures  # noqa: E402
from neuron_disagg.vllm.scheduler_side import transfer_key  # noqa: E402
from neuron_disagg.vllm.stats import ConnectorStats, empty  # noqa: E402

VLLM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}


def _app() -> TestClient:
    async def failed(request):  # what vLLM answers for a request that finished with an error
        return JSONResponse(VLLM_ERROR, status_code=500)

    async def streamed(request):
        async def events():
            yield b'data: {"choices": []}\n\n'
            yield b"data: " + json.dumps(VLLM_ERROR).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def failed_first(request):  # the stats carrying the reason come just after the error does
        asyncio.get_running_loop().call_later(0.2, failures.remember, {"req.12#0": "lease expired"})
        return JSONResponse(VLLM_ERROR, status_code=500)

    async def silent(request):  # vLLM 0.29: a request that failed before its first token streams nothing
        async def events():
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def tokens(request):
        async def events():
            yield b'data: {"choices": [{"text": "hi"}]}\n\n'
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def fine(request):
        return JSONResponse({"choices": [{"text": "Internal server error"}]})

    app = FastAPI(routes=[Route("/failed", failed, methods=["POST"]), Route("/streamed", streamed, methods=["POST"]),
                          Route("/fine", fine, methods=["POST"]), Route("/silent", silent, methods=["POST"]),
                          Route("/tokens", tokens, methods=["POST"]),
                          Route("/failed_first", failed_first, methods=["POST"])])  # vLLM's server is a FastAPI app
    app.middleware("http")(failures.kv_failure_reasons)  # as vLLM registers --middleware functions
    return TestClient(app)


def test_the_router_transfer_id_is_recovered_from_each_prompts_transfer():
    sent = TransferId("cmpl-abc.1f2e/with/slashes", 3)
    assert failures.router_transfer_id(transfer_key(sent, [1, 2, 3])) == "cmpl-abc.1f2e/with/slashes#3"


def test_a_failed_request_named_by_the_router_is_told_why_answered_or_streamed():
    client = _app()
    failures.remember({"req.7#0": "lease expired", "req.8#1": 'write failed: "remote" error'})
    r = client.post("/failed", headers={"X-Request-Id": "req.7#0"})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "KV transfer failed: lease expired (kv_load_failure_policy: fail)"
    events = client.post("/streamed", headers={"X-Request-Id": "req.8#1"}).text.split("\n\n")
    assert json.loads(events[1][len("data: "):])["error"]["message"].startswith(
        'KV transfer failed: write failed: "remote" error')
    assert "req.7#0" not in failures._recent  # told once


def test_other_answers_pass_unchanged(monkeypatch):
    client = _app()
    failures.remember({"req.9#0": "lease expired"})
    assert client.post("/fine", headers={"X-Request-Id": "req.9#0"}).json()["choices"][0]["text"] == "Internal server error"
    monkeypatch.setattr(failures, "_WAIT_S", 0.05)  # no reason will come: the wait ends at its deadline
    r = client.post("/failed", headers={"X-Request-Id": "unknown#0"})  # not a KV failure: vLLM's own answer
    assert r.json() == VLLM_ERROR and not failures._waiting


def test_reasons_from_several_ranks_merge_and_reach_the_api_server_process():
    rank0 = ConnectorStats({**empty(), "failed_requests": {"a#0": "lease expired"}})
    rank1 = ConnectorStats({**empty(), "failed_requests": {"b#0": "watchdog"}})
    merged = rank0.aggregate(rank1)
    assert not merged.is_empty() and merged.data["failed_requests"] == {"a#0": "lease expired", "b#0": "watchdog"}


def test_a_stream_that_ended_with_nothing_but_done_is_told_why_first(monkeypatch):
    client = _app()
    failures.remember({"req.10#0": "no KV from prefill within watchdog_s"})
    events = [e for e in client.post("/silent", headers={"X-Request-Id": "req.10#0"}).text.split("\n\n") if e]
    assert json.loads(events[0][len("data: "):])["error"]["message"].startswith("KV transfer failed: no KV")
    assert events[-1] == "data: [DONE]"
    waited = []
    original = failures._reason

    async def reason(transfer_id):
        waited.append(transfer_id)
        return await original(transfer_id)

    monkeypatch.setattr(failures, "_reason", reason)
    assert client.post("/tokens", headers={"X-Request-Id": "req.11#0"}).text.count("data: ") == 2  # untouched
    assert waited == []  # and not delayed: a stream that answered never waits for a reason


def test_a_reason_that_comes_after_the_error_wakes_the_answer_waiting_for_it(monkeypatch):
    """The answer waits for its reason: the reason's arrival wakes it (were it the deadline, the
    answer would keep vLLM's bare error). The deadline is put far off, so that a loaded machine
    delivering the reason late still tests the rule, not its speed."""
    monkeypatch.setattr(failures, "_WAIT_S", 60.0)
    client = _app()
    r = client.post("/failed_first", headers={"X-Request-Id": "req.12#0"})
    assert r.json()["error"]["message"] == "KV transfer failed: lease expired (kv_load_failure_policy: fail)"
    assert not failures._waiting and "req.12#0" not in failures._recent
