"""Push and pull through the router: the legs' bodies and kv_transfer_params, their order in
time, streaming passthrough, and the per-request mode override."""

from __future__ import annotations

import asyncio
import json

import pytest

from .conftest import cluster, completion, until


async def test_push_sends_both_legs_at_once_under_one_transfer_id():
    async with cluster(prefill=1, decode=1, mode="push") as c:
        p, d = c.prefills[0], c.decodes[0]
        p.hold = asyncio.Event()  # P "computes" until the test says so
        task = asyncio.create_task(c.post("/v1/completions", completion(max_tokens=7)))
        await until(lambda: p.requests and d.requests, "both legs to arrive")
        # D's leg is there while P is still computing: the legs were sent concurrently.
        assert p.requests[0].finished_at is None
        p.hold.set()
        status, headers, answer = await task
        assert status == 200, answer
        assert answer["served_by"] == "d0" and answer["choices"][0]["text"] == "hello world"
        pr, dr = p.requests[0], d.requests[0]
        assert dr.at < pr.finished_at
        tid = pr.transfer_id
        assert tid and tid.endswith("#0") and tid.split("#")[0] == headers["X-Request-Id"]
        assert pr.params == {"neuron_disagg": 1, "role": "prefill", "mode": "push", "transfer_id": tid, "prompts": 1}
        assert dr.params == {"neuron_disagg": 1, "role": "decode", "mode": "push", "transfer_id": tid,
                             "p_side_channel": "127.0.0.1:5600", "p_tp_size": 1, "prompts": 1}
        assert pr.body["max_tokens"] == 1 and pr.body["stream"] is False
        assert dr.body["max_tokens"] == 7 and "stream" not in dr.body
        assert pr.headers["X-Request-Id"] == tid == dr.headers["X-Request-Id"]


async def test_pull_sends_decode_after_prefill_with_prefills_params():
    async with cluster(prefill=1, decode=1, mode="pull") as c:
        p, d = c.prefills[0], c.decodes[0]
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 200, answer
        pr, dr = p.requests[0], d.requests[0]
        assert pr.finished_at is not None and dr.at >= pr.finished_at
        tid = pr.transfer_id
        assert pr.params == {"neuron_disagg": 1, "role": "prefill", "mode": "pull", "transfer_id": tid, "prompts": 1}
        assert dr.params == {"neuron_disagg": 1, "role": "decode", "mode": "pull", "transfer_id": tid,
                             "offers": [p.pull_params(completion()["prompt"])["offer"]], "prompts": 1}


async def test_pull_with_a_prompt_list_carries_every_distinct_prompts_offer_to_decode():
    """P answers one request with the first prompt's kv_transfer_params only, so each distinct
    prompt gets a P leg of its own; D gets one request with every offer (it picks each prompt's)."""
    async with cluster(prefill=1, decode=1, mode="pull") as c:
        p, d = c.prefills[0], c.decodes[0]
        prompts = ["first prompt", "second prompt", "first prompt"]
        status, _, answer = await c.post("/v1/completions", completion(prompt=prompts, n=2))
        assert status == 200, answer
        assert sorted(r.body["prompt"] for r in p.requests) == ["first prompt", "second prompt"]
        assert all("n" not in r.body for r in p.requests)  # P computes each prompt once; D samples
        (dr,) = d.requests
        assert dr.body["prompt"] == prompts and dr.body["n"] == 2
        assert sorted(dr.params["offers"]) == sorted(p.pull_params(x)["offer"] for x in ("first prompt", "second prompt"))


async def test_prompt_logprobs_are_refused_up_front():
    async with cluster(prefill=1, decode=1) as c:
        for extra, named in (({"prompt_logprobs": 1}, "prompt_logprobs"), ({"echo": True, "logprobs": 2}, "echo")):
            status, _, answer = await c.post("/v1/completions", completion(**extra))
            assert status == 400 and named in answer["error"]["message"], answer
        assert not c.prefills[0].requests and not c.decodes[0].requests


async def test_pull_without_kv_transfer_params_from_prefill_is_a_502():
    async with cluster(prefill=1, decode=1, mode="pull") as c:
        c.prefills[0].omit_kv_params = True
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 502
        assert answer["error"]["code"] == "prefill_no_kv_transfer_params"
        assert "kv_transfer_params" in answer["error"]["message"]
        assert not c.decodes[0].requests


async def test_request_overrides_the_deployment_mode_and_the_field_is_stripped():
    async with cluster(prefill=1, decode=1, mode="push") as c:
        p, d = c.prefills[0], c.decodes[0]
        status, _, _ = await c.post("/v1/completions", completion(disagg_mode="pull"))
        assert status == 200
        assert p.requests[0].params["mode"] == "pull" and d.requests[0].params["mode"] == "pull"
        assert d.requests[0].at >= p.requests[0].finished_at
        status, _, _ = await c.post("/v1/completions", completion(disagg_mode="push"))
        assert status == 200
        assert p.requests[1].params["mode"] == "push" and d.requests[1].params["mode"] == "push"
        for rec in p.requests + d.requests:
            assert "disagg_mode" not in rec.body


async def test_streaming_passes_chunks_through_as_they_come():
    async with cluster(prefill=1, decode=1) as c:
        d = c.decodes[0]
        d.chunks, d.chunk_gate = 3, asyncio.Queue()
        async with c.client.post(c.url + "/v1/completions",
                                 json=completion(stream=True, stream_options={"include_usage": True})) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            seen = []
            for i in range(3):
                line = await asyncio.wait_for(resp.content.readline(), 5)
                assert line.startswith(b"data: ")
                seen.append(json.loads(line[6:])["choices"][0]["text"])
                # D has not been allowed to send the next chunk yet, and the client has this one.
                assert d.requests[0].chunks_sent == i + 1
                assert await resp.content.readline() == b"\n"
                d.chunk_gate.put_nowait(None)
            rest = await resp.content.read()
        assert seen == ["tok0 ", "tok1 ", "tok2 "]
        assert rest == b"data: [DONE]\n\n"
        pr, dr = c.prefills[0].requests[0], d.requests[0]
        assert pr.body["stream"] is False and "stream_options" not in pr.body
        assert dr.body["stream"] is True and dr.body["stream_options"] == {"include_usage": True}


async def test_chat_completions_stream_and_not():
    async with cluster(prefill=1, decode=1) as c:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi " * 40}],
                "max_completion_tokens": 9, "min_tokens": 2}
        status, _, answer = await c.post("/v1/chat/completions", body)
        assert status == 200 and answer["object"] == "chat.completion"
        events = await c.stream(body, path="/v1/chat/completions")
        assert events[-1] == "[DONE]" and len(events) == 4
        for pr in c.prefills[0].requests:
            assert pr.path == "/v1/chat/completions"
            assert pr.body["max_tokens"] == 1 and pr.body["max_completion_tokens"] == 1
            assert "min_tokens" not in pr.body
        for dr in c.decodes[0].requests:
            assert dr.path == "/v1/chat/completions" and dr.body["max_completion_tokens"] == 9
            assert dr.body["min_tokens"] == 2


async def test_client_kv_transfer_params_are_replaced_by_the_routers():
    async with cluster(prefill=1, decode=1) as c:
        forged = {"role": "decode", "transfer_id": "someone-else#0", "p_side_channel": "6.6.6.6:1"}
        status, _, _ = await c.post("/v1/completions", completion(kv_transfer_params=forged))
        assert status == 200
        assert c.decodes[0].requests[0].params["p_side_channel"] == "127.0.0.1:5600"
        assert c.prefills[0].requests[0].params["transfer_id"] != "someone-else#0"


async def test_stream_broken_mid_way_ends_with_an_error_event():
    async with cluster(prefill=1, decode=1) as c:
        c.decodes[0].chunks, c.decodes[0].stream_then_die_after = 4, 2
        events = await c.stream(completion())
        assert len(events) == 3
        error = json.loads(events[-1])["error"]
        assert error["code"] == "decode_stream_broken" and error["type"] == "upstream_error"


async def test_vllm_push_drives_vllms_connector_with_its_own_params_and_one_request_id():
    """vLLM's NixlPushConnector pairs P and D by X-Request-Id and needs P's engine id and side
    channel: the reference mode for the side-by-side benchmark."""
    async with cluster(prefill=1, decode=1, mode="vllm-push") as c:
        p, d = c.prefills[0], c.decodes[0]
        p.hold = asyncio.Event()
        task = asyncio.create_task(c.post("/v1/completions", completion(max_tokens=5)))
        await until(lambda: p.requests and d.requests, "both legs to arrive")
        assert p.requests[0].finished_at is None  # D registered while P computes
        p.hold.set()
        status, _, answer = await task
        assert status == 200, answer
        pr, dr = p.requests[0], d.requests[0]
        assert pr.params == {"do_remote_decode": True, "do_remote_prefill": False}
        assert dr.params == {"do_remote_prefill": True, "do_remote_decode": False,
                             "remote_engine_id": "engine-p0", "remote_host": "127.0.0.1",
                             "remote_request_id": f"cmpl-{pr.headers['X-Request-Id']}-0",
                             "remote_port": 5600, "tp_size": 1}
        assert pr.headers["X-Request-Id"] == dr.headers["X-Request-Id"]
        assert pr.body["max_tokens"] == 1 and dr.body["max_tokens"] == 5


async def test_vllm_pull_passes_prefills_answer_to_decode_verbatim():
    async with cluster(prefill=1, decode=1, mode="vllm-pull") as c:
        p, d = c.prefills[0], c.decodes[0]
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 200, answer
        pr, dr = p.requests[0], d.requests[0]
        assert pr.finished_at is not None and dr.at >= pr.finished_at
        assert pr.params == {"do_remote_decode": True, "do_remote_prefill": False}
        assert dr.params == p.reference_params()


@pytest.mark.parametrize("mode", ["push", "vllm-pull"])
async def test_router_marks_arrival_p_answer_and_first_byte_on_the_timeline(tmp_path, mode):
    """In every mode, vLLM's own connectors too: the bench splits each mode's TTFT at P's answer."""
    from neuron_disagg import timeline

    async with cluster(prefill=1, decode=1, mode=mode, timeline_dir=str(tmp_path)) as c:
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 200, answer
        tid = c.prefills[0].requests[0].transfer_id
    events = timeline.load(tmp_path)[tid]
    assert set(events) == {"router_arrived", "router_d_bound", "router_p_answered", "router_first_byte"}
    if mode == "vllm-pull":  # pull chooses D once P answered; push (bound at arrival) before
        assert events["router_d_bound"] >= events["router_p_answered"]
    else:
        assert events["router_d_bound"] <= events["router_p_answered"]
    assert 0 < events["router_first_byte"] - events["router_arrived"] < 20
    split = timeline.p_and_after(events)
    assert 0 < split["until_p_answered"] < 20
    assert split["until_p_answered"] + split["after_p_answered"] == pytest.approx(
        events["router_first_byte"] - events["router_arrived"])


async def test_our_modes_sign_their_params_and_a_router_without_the_secret_sends_no_leg():
    async with cluster(prefill=1, decode=1, mode="push") as c:
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 200, answer
        raw = c.decodes[0].requests[0].body["kv_transfer_params"]
        assert {"expires_ms", "signature"} <= raw.keys()  # the fake D verified it (Received.params)
        assert c.decodes[0].requests[0].params["p_side_channel"] == "127.0.0.1:5600"
    async with cluster(prefill=1, decode=1, mode="vllm-pull", signed=False) as c:
        status, _, answer = await c.post("/v1/completions", completion(disagg_mode="push"))
        assert status == 503 and answer["error"]["code"] == "router_without_secret", answer
        assert "NEURON_DISAGG_SECRET" in answer["error"]["message"]
        assert not c.prefills[0].requests and not c.decodes[0].requests
        status, _, answer = await c.post("/v1/completions", completion())  # vLLM's connectors need none
        assert status == 200, answer
