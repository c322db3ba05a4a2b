"""What the router does when a leg fails, hangs, or the client goes away."""

from __future__ import annotations

import asyncio

import pytest

from neuron_disagg.local_cluster import free_port
from neuron_disagg.protocol import TransferId, Withdraw, WireCodec
from neuron_disagg.transfer.side_channel import SideChannelServer

from .conftest import cluster, completion, until
from .fakes import SECRET


def _metric(c, name: str, **labels: str) -> float:
    value = c.router.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def test_prefill_failure_cancels_decode_leg_and_retries_on_another_prefill():
    async with cluster(prefill=2, decode=1, mode="push") as c:
        p0, p1 = c.prefills
        d = c.decodes[0]
        p0.hold, p0.fail_status = asyncio.Event(), 500  # the first pick (ties go in list order)
        task = asyncio.create_task(c.post("/v1/completions", completion()))
        await until(lambda: p0.requests and d.requests, "attempt 0 to reach P0 and D")
        p0.hold.set()  # now P0 fails, while D waits for KV under attempt 0
        status, headers, answer = await task
        assert status == 200, answer
        assert answer["served_by"] == "d0"
        t0, t1 = p0.requests[0].transfer_id, p1.requests[0].transfer_id
        base = t0.rpartition("#")[0]
        assert t0 == f"{base}#0" and t1 == f"{base}#1"
        assert [r.transfer_id for r in d.requests] == [t0, t1]
        assert d.requests[1].params["p_side_channel"] == "127.0.0.1:5601"
        assert d.requests[1].params["p_tp_size"] == 2
        await until(lambda: d.requests[0].cancelled, "D to see attempt 0's leg closed")
        assert not d.requests[1].cancelled
        assert _metric(c, "neuron_disagg_router_retries_total", mode="push", reason="prefill_error") == 1
        assert _metric(c, "neuron_disagg_router_failures_total", reason="prefill_error") == 1


async def test_prefill_failing_twice_is_an_openai_error_and_every_decode_leg_is_closed():
    async with cluster(prefill=3, decode=1, mode="push", decode_fallback=False) as c:
        for p in c.prefills:
            p.fail_status = 500
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 502
        assert answer["error"]["code"] == "prefill_error"
        assert answer["error"]["type"] == "upstream_error"
        assert "answered 500" in answer["error"]["message"]
        assert sum(len(p.requests) for p in c.prefills) == 2  # one retry, not more
        await until(lambda: all(c.instance(d).in_flight == 0 for d in c.decodes), "D legs released")
        for rec in c.decodes[0].requests:  # each D leg that got through was closed, not answered
            assert rec.finished_at is None


async def test_unreachable_prefill_is_ejected_and_the_request_retried():
    async with cluster(prefill=2, decode=1, mode="push") as c:
        await c.prefills[0].stop()
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 200, answer
        assert c.prefills[1].requests[0].transfer_id.endswith("#1")
        assert not c.instance(c.prefills[0]).healthy
        status, _, _ = await c.post("/v1/completions", completion())
        assert status == 200 and c.prefills[1].requests[1].transfer_id.endswith("#0")


async def test_only_prefill_failing_is_its_own_error_not_a_503():
    async with cluster(prefill=1, decode=1, mode="push", decode_fallback=False) as c:
        c.prefills[0].fail_status = 500
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 502 and answer["error"]["code"] == "prefill_error"
        assert len(c.prefills[0].requests) == 1


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_a_request_whose_prefill_failed_with_no_other_left_is_computed_whole_by_decode(mode):
    """The only P answers 500 (its engine died): D computes the request itself, a plain request
    without kv_transfer_params, rather than the client getting a 502; the push leg D got first is
    closed, so D's connector gives up that transfer."""
    async with cluster(prefill=1, decode=1, mode=mode) as c:
        c.prefills[0].fail_status = 500
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 200 and answer["served_by"] == "d0", answer
        whole = c.decodes[0].requests[-1]
        assert "kv_transfer_params" not in whole.body and whole.headers["X-Request-Id"].endswith("#1")
        if mode == "push":
            await until(lambda: c.decodes[0].requests[0].cancelled, "D's push leg to be closed")
        assert _metric(c, "neuron_disagg_router_computed_on_decode_total", mode=mode, reason="prefill_error") == 1


async def test_with_every_prefill_ejected_decode_computes_requests_whole_instead_of_a_503():
    async with cluster(prefill=1, decode=1, mode="push") as c:
        await c.prefills[0].stop()
        status, _, answer = await c.post("/v1/completions", completion())  # unreachable: ejected, then D
        assert status == 200 and answer["served_by"] == "d0", answer
        assert not c.instance(c.prefills[0]).healthy
        status, _, answer = await c.post("/v1/completions", completion())  # no P at all: straight to D
        assert status == 200 and answer["served_by"] == "d0", answer
        assert _metric(c, "neuron_disagg_router_computed_on_decode_total", mode="push", reason="no_prefill") == 1
        assert _metric(c, "neuron_disagg_router_computed_on_decode_total", mode="push",
                       reason="prefill_unreachable") == 1


async def test_without_decode_fallback_no_healthy_prefill_is_a_503():
    async with cluster(prefill=1, decode=1, mode="push", decode_fallback=False) as c:
        await c.prefills[0].stop()
        await c.post("/v1/completions", completion())
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 503, answer


async def test_health_says_degraded_with_no_prefill_while_decodes_compute_requests_whole():
    for fallback, want in ((True, (200, "degraded")), (False, (503, "unavailable"))):
        async with cluster(prefill=1, decode=1, mode="push", decode_fallback=fallback) as c:
            c.router.pool.set_health(c.instance(c.prefills[0]), False)
            async with c.client.get(c.url + "/health") as resp:
                assert (resp.status, (await resp.json())["status"]) == want
            c.router.pool.set_health(c.instance(c.decodes[0]), False)
            async with c.client.get(c.url + "/health") as resp:
                assert resp.status == 503


async def test_prefill_timeout_is_a_504_without_retry_and_closes_the_decode_leg():
    async with cluster(prefill=2, decode=1, mode="push", prefill_timeout_s=0.3) as c:
        c.prefills[0].hang = True
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 504 and answer["error"]["code"] == "prefill_timeout"
        assert not c.prefills[1].requests  # a retry would double the wait
        await until(lambda: c.prefills[0].requests[0].cancelled and c.decodes[0].requests[0].cancelled,
                    "both legs to be closed")


async def test_prefill_4xx_is_relayed_without_retry():
    async with cluster(prefill=2, decode=1, mode="push") as c:
        c.prefills[0].fail_status = 400
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 400 and answer["message"] == "p0 failed on purpose"
        assert not c.prefills[1].requests


async def test_pull_prefill_failure_retries_with_the_next_attempt():
    async with cluster(prefill=2, decode=1, mode="pull") as c:
        c.prefills[0].fail_status = 503
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 200, answer
        assert c.prefills[0].requests[0].transfer_id.endswith("#0")
        tid = c.prefills[1].requests[0].transfer_id
        assert tid.endswith("#1") and [r.transfer_id for r in c.decodes[0].requests] == [tid]


async def test_decode_failures_are_openai_errors_with_a_reason():
    async with cluster(prefill=1, decode=1, mode="push", decode_first_byte_timeout_s=1.0) as c:
        d = c.decodes[0]
        for fail_status, want_status, want_code in ((500, 502, "decode_error"),
                                                    (503, 503, "decode_error")):
            d.fail_status = fail_status
            status, headers, answer = await c.post("/v1/completions", completion())
            assert status == want_status, answer
            assert answer["error"]["code"] == want_code and "X-Request-Id" in headers
            assert set(answer["error"]) == {"message", "type", "code"}
        d.fail_status, d.hang = None, True
        status, _, answer = await c.post("/v1/completions", completion(stream=True))
        assert status == 504 and answer["error"]["code"] == "decode_timeout"
        assert answer["error"]["type"] == "timeout_error"
        await until(lambda: d.requests[-1].cancelled, "the hung D leg to be closed")
        await d.stop()
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 502 and answer["error"]["code"] == "decode_unreachable"
        assert _metric(c, "neuron_disagg_router_requests_total", mode="push", outcome="timeout") == 1


async def test_client_disconnect_cancels_both_legs():
    async with cluster(prefill=1, decode=1, mode="push") as c:
        p, d = c.prefills[0], c.decodes[0]
        p.hold = asyncio.Event()  # P never finishes; D waits for its KV
        task = asyncio.create_task(c.post("/v1/completions", completion(stream=True)))
        await until(lambda: p.requests and d.requests, "both legs to arrive")
        task.cancel()  # the client hangs up
        await until(lambda: p.requests[0].cancelled and d.requests[0].cancelled,
                    "P and D to see their legs closed")
        await until(lambda: all(i.in_flight == 0 and i.prompt_tokens == 0 for i in c.router.pool.all()),
                    "the router's leases to be released")
        await until(lambda: _metric(c, "neuron_disagg_router_requests_total", mode="push",
                                    outcome="cancelled") == 1, "the request counted as cancelled")


async def test_client_disconnect_mid_stream_closes_the_decode_leg():
    async with cluster(prefill=1, decode=1, mode="push") as c:
        d = c.decodes[0]
        d.chunks, d.chunk_gate = 5, asyncio.Queue()
        resp = await c.client.post(c.url + "/v1/completions", json=completion(stream=True))
        assert resp.status == 200
        assert (await asyncio.wait_for(resp.content.readline(), 5)).startswith(b"data: ")
        resp.close()  # hang up after the first chunk
        await until(lambda: d.requests[0].cancelled, "D to see the stream closed")
        await until(lambda: c.instance(d).in_flight == 0, "the D lease to be released")


async def test_a_leg_whose_connection_is_dropped_unanswered_is_sent_once_more():
    """A vLLM resuming from a pause longer than its keep-alive timeout drops the connections that
    requests reached it on meanwhile: each leg is sent again, once, on the same instance."""
    for mode in ("push", "pull"):
        async with cluster(prefill=1, decode=1, mode=mode, decode_fallback=False) as c:
            p, d = c.prefills[0], c.decodes[0]
            p.reset_next = d.reset_next = 1
            status, _, answer = await c.post("/v1/completions", completion())
            assert status == 200, answer
            assert len(p.requests) == 2 and len(d.requests) == 2
            assert p.requests[0].transfer_id == p.requests[1].transfer_id  # the same leg, not a new attempt
            p.reset_next = 2  # and not more than once
            status, _, answer = await c.post("/v1/completions", completion())
            assert status == 502 and answer["error"]["code"] == "prefill_disconnected", answer


async def test_a_leg_sent_once_more_goes_out_on_a_new_connection():
    """An instance resuming from a long pause drops every kept-alive connection at once, so the
    router's second send must not take another idle one from its pool (in CI it did: the leg
    failed with 502 prefill_disconnected)."""
    for mode in ("push", "pull"):
        for role in ("prefill", "decode"):
            async with cluster(prefill=1, decode=1, mode=mode) as c:
                fake = (c.prefills if role == "prefill" else c.decodes)[0]
                hold = fake.hold = asyncio.Event()  # four legs at once: four connections in the pool
                tasks = [asyncio.create_task(c.post("/v1/completions", completion())) for _ in range(4)]
                await until(lambda: fake.active == 4, f"four legs held on {role}")
                fake.hold = None
                hold.set()
                assert [(await task)[0] for task in tasks] == [200] * 4
                fake.drop_kept_alive = True
                status, _, answer = await c.post("/v1/completions", completion())
                assert status == 200, (mode, role, answer)
                assert fake.dropped == 1  # sent on a kept-alive connection first, then on a new one


async def test_decodes_kv_transfer_failure_reaches_the_client_with_its_reason():
    """D under kv_load_failure_policy: fail answers 500 saying why its KV did not come
    (neuron_disagg/vllm/failures.py): the client gets that reason, not "answered 500: {...}"."""
    async with cluster(prefill=1, decode=1, mode="push") as c:
        d = c.decodes[0]
        d.fail_status = 500
        d.fail_body = {"error": {"message": "KV transfer failed: lease expired (kv_load_failure_policy: fail)",
                                 "type": "InternalServerError", "param": None, "code": 500}}
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 502 and answer["error"]["code"] == "kv_transfer_failed", answer
        assert answer["error"]["message"].startswith("KV transfer failed: lease expired")
        assert d.url in answer["error"]["message"]
        d.fail_body = {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}
        status, _, answer = await c.post("/v1/completions", completion())
        assert answer["error"]["code"] == "decode_error"
        assert answer["error"]["message"].endswith("answered 500: Internal server error"), answer


async def test_prefill_is_told_when_no_decode_takes_the_request():
    """D refused the request (4xx: a parameter P's one-token leg did not carry) or could not be
    reached: every rank of P gets a signed Withdraw for the attempt, so it frees the prompt's KV
    now instead of holding it for its lease. D failing in any other way may have registered or be
    reading: then nothing is sent."""
    codec, port = WireCodec(SECRET), free_port()
    got: list = []
    servers = [SideChannelServer("127.0.0.1", port + rank, codec, lambda m, rank=rank: got.append((rank, m))).start()
               for rank in range(2)]
    try:
        for mode in ("push", "pull"):
            for fault, withdrawn in (("refused", True), ("stopped", True), ("failed", False)):
                got.clear()
                async with cluster(mode=mode, codec=codec, p_side_channel=(f"127.0.0.1:{port}", 2)) as c:
                    d = c.decodes[0]
                    if fault == "stopped":
                        await d.stop()
                    else:
                        d.fail_status = 400 if fault == "refused" else 500
                    status, headers, answer = await c.post("/v1/completions", completion())
                    assert status == {"refused": 400, "stopped": 502, "failed": 502}[fault], (mode, fault, answer)
                    assert _metric(c, "neuron_disagg_router_withdrawals_total") == (1 if withdrawn else 0), (mode, fault)
                    if withdrawn:
                        await until(lambda: len(got) == 2, "a Withdraw on both of P's ranks")
                        tid = c.prefills[0].requests[0].transfer_id
                        assert sorted(rank for rank, _ in got) == [0, 1]
                        assert all(m == Withdraw(TransferId(*tid.split("#")[0:1], int(tid.split("#")[1])), m.reason)
                                   for _, m in got), got
                        assert ("refused" in got[0][1].reason) == (fault == "refused"), got
    finally:
        for server in servers:
            server.close()


async def test_a_push_answer_reaches_the_client_while_the_prefill_leg_is_still_open():
    """D answers without P (it gave the load up: P stopped, its probes unanswered) while P's leg
    hangs: a non-streaming client gets D's answer at once, and P's leg is drained behind it. Before,
    the answer waited for P's leg (until P resumed, or prefill_timeout_s)."""
    async with cluster(prefill=1, decode=1, mode="push") as c:
        p, d = c.prefills[0], c.decodes[0]
        p.hold, d.wait_for_kv = asyncio.Event(), False
        status, _, answer = await asyncio.wait_for(c.post("/v1/completions", completion()), 5)
        assert status == 200 and answer["served_by"] == "d0", answer
        assert p.requests and p.requests[0].finished_at is None and not p.requests[0].cancelled
        p.hold.set()
        await until(lambda: p.requests[0].finished_at is not None, "P's leg to be drained")
        await until(lambda: c.instance(p).in_flight == 0, "P's lease released")
