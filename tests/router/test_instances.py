"""Choosing instances by load, health ejection and readmission, and the admin endpoints."""

from __future__ import annotations

import asyncio

from .conftest import cluster, completion, until


async def test_busy_prefill_is_avoided():
    async with cluster(prefill=2, decode=1) as c:
        for p in c.prefills:
            p.hold = asyncio.Event()
        long = asyncio.create_task(c.post("/v1/completions", completion("word " * 2000)))
        busy = await until(lambda: next((p for p in c.prefills if p.requests), None), "the long prompt")
        idle = next(p for p in c.prefills if p is not busy)
        assert c.instance(busy).prompt_tokens == 2500
        idle.hold.set()
        for _ in range(4):
            status, _, _ = await c.post("/v1/completions", completion("short"))
            assert status == 200
        assert len(idle.requests) == 4 and len(busy.requests) == 1
        busy.hold.set()
        assert (await long)[0] == 200
        assert all(c.instance(p).prompt_tokens == 0 for p in c.prefills)


async def test_token_id_prompts_are_counted_exactly():
    async with cluster(prefill=1, decode=1) as c:
        p = c.prefills[0]
        p.hold = asyncio.Event()
        task = asyncio.create_task(c.post("/v1/completions", completion(list(range(777)))))
        await until(lambda: p.requests, "the P leg")
        assert c.instance(p).prompt_tokens == 777
        p.hold.set()
        assert (await task)[0] == 200


async def test_decode_with_more_running_sequences_is_avoided():
    async with cluster(prefill=1, decode=2, health_interval_s=0.05) as c:
        d0, d1 = c.decodes
        d0.running, d0.waiting = 40, 10  # as d0's own /metrics reports
        await until(lambda: c.instance(d0).engine and c.instance(d0).engine.running == 40,
                    "the router to scrape d0's /metrics")
        for _ in range(3):
            assert (await c.post("/v1/completions", completion()))[0] == 200
        assert not d0.requests and len(d1.requests) == 3
        # KV nearly full outweighs fewer sequences.
        d0.running, d0.waiting, d1.kv_usage = 0, 0, 0.99
        await until(lambda: c.instance(d1).engine.kv_cache_usage == 0.99 and
                    c.instance(d0).engine.running == 0, "the next scrape")
        assert (await c.post("/v1/completions", completion()))[0] == 200
        assert len(d0.requests) == 1


async def test_decode_with_open_streams_is_avoided():
    async with cluster(prefill=1, decode=2) as c:
        for d in c.decodes:
            d.chunk_gate = asyncio.Queue()
        resp = await c.client.post(c.url + "/v1/completions", json=completion(stream=True))
        await resp.content.readline()
        busy = next(d for d in c.decodes if d.requests)
        idle = next(d for d in c.decodes if d is not busy)
        idle.chunk_gate = None
        for _ in range(3):
            assert len(await c.stream(completion())) == 4
        assert len(idle.requests) == 3 and len(busy.requests) == 1
        busy.chunk_gate.put_nowait(None)
        busy.chunk_gate.put_nowait(None)
        assert (await resp.content.read()).endswith(b"data: [DONE]\n\n")
        resp.close()


async def test_a_decode_whose_streams_went_quiet_is_picked_last_even_when_it_runs_fewer():
    async with cluster(prefill=1, decode=2, decode_silent_s=0.2) as c:
        talking, quiet = c.decodes
        talking.chunks, talking.chunk_interval_s = 400, 0.01  # long streams, a chunk every 10 ms
        quiet.chunk_gate = asyncio.Queue()  # its stream sends its first chunk, then nothing
        streams = [await c.client.post(c.url + "/v1/completions", json=completion(stream=True)) for _ in range(3)]
        for resp in streams:
            await resp.content.readline()
        assert (len(talking.requests), len(quiet.requests)) == (2, 1)  # by load, then in turns
        await asyncio.sleep(0.4)
        # by load alone the quiet D (one running, against two) would be the choice
        assert (await c.post("/v1/completions", completion()))[0] == 200
        assert (len(talking.requests), len(quiet.requests)) == (3, 1)
        for resp in streams:
            resp.close()


async def test_one_failed_health_check_does_not_eject_a_busy_instance():
    async with cluster(prefill=1, decode=1, health_interval_s=0.2, health_timeout_s=0.5) as c:
        d0 = c.decodes[0]
        d0.health_ok = False
        await until(lambda: c.instance(d0).failed_checks >= 1, "a failed check")
        assert c.instance(d0).healthy  # a single bad answer is not death
        d0.health_ok = True
        await until(lambda: c.instance(d0).failed_checks == 0, "the next check to pass")
        assert (await c.post("/v1/completions", completion()))[0] == 200


async def test_health_checks_eject_and_readmit():
    async with cluster(prefill=2, decode=2, health_interval_s=0.05, health_timeout_s=0.5) as c:
        d0 = c.decodes[0]
        d0.health_ok = False
        await until(lambda: not c.instance(d0).healthy, "d0 to be ejected")
        for _ in range(3):
            assert (await c.post("/v1/completions", completion()))[0] == 200
        assert not d0.requests
        d0.health_ok = True
        await until(lambda: c.instance(d0).healthy, "d0 to be readmitted")
        # A dead instance (connection refused) is ejected, and readmitted once it is back.
        p0 = c.prefills[0]
        await p0.stop()
        await until(lambda: not c.instance(p0).healthy, "dead p0 to be ejected")
        status, body = await c.admin("GET")
        assert {"url": p0.url, "healthy": False} .items() <= next(
            i for i in body["instances"] if i["url"] == p0.url).items()
        async with c.client.get(c.url + "/health") as resp:
            assert resp.status == 200  # one P and both Ds are still up
        await p0.start()
        await until(lambda: c.instance(p0).healthy, "p0 to be readmitted")
        gauge = c.router.metrics.registry.get_sample_value(
            "neuron_disagg_router_instance_healthy", {"role": "prefill", "url": p0.url})
        assert gauge == 1.0


async def test_router_health_reflects_instances():
    async with cluster(prefill=1, decode=1) as c:
        async with c.client.get(c.url + "/health") as resp:
            assert resp.status == 200
            assert (await resp.json())["healthy_decode"] == 1
        assert (await c.admin("DELETE", {"url": c.decodes[0].url}))[0] == 200
        async with c.client.get(c.url + "/health") as resp:
            assert resp.status == 503 and (await resp.json())["healthy_decode"] == 0
        status, _, answer = await c.post("/v1/completions", completion())
        assert status == 503 and answer["error"]["code"] == "no_decode_instance"


async def test_admin_adds_and_removes_instances():
    async with cluster(prefill=1, decode=1) as c:
        from .fakes import FakeVllm
        d_new = await FakeVllm("decode", c.board, "d-new").start()
        p_new = await FakeVllm("prefill", c.board, "p-new").start()
        try:
            status, body = await c.admin("POST", {"role": "decode", "url": d_new.url + "/"})
            assert status == 201 and body["url"] == d_new.url and body["healthy"]
            status, body = await c.admin("POST", {"role": "prefill", "url": p_new.url,
                                                  "side_channel": "10.1.2.3:7000", "tp": 4})
            assert status == 201 and body["side_channel"] == "10.1.2.3:7000" and body["tp"] == 4
            assert (await c.admin("POST", {"role": "decode", "url": d_new.url}))[0] == 409
            status, body = await c.admin("POST", {"role": "encoder", "url": d_new.url})
            assert status == 400 and "role must be" in body["error"]["message"]
            status, body = await c.admin("POST", {"role": "prefill", "url": p_new.url + "1", "tp": 0})
            assert status == 400 and "tp" in body["error"]["message"]
            # Remove the original P and D: new requests go to the added ones.
            for fake in (c.prefills[0], c.decodes[0]):
                assert (await c.admin("DELETE", {"url": fake.url}))[0] == 200
            status, body = await c.admin("DELETE", {"url": c.decodes[0].url})
            assert status == 404 and body["error"]["code"] == "unknown_instance"
            assert (await c.post("/v1/completions", completion()))[0] == 200
            assert d_new.requests and p_new.requests
            params = d_new.requests[0].params
            assert params["p_side_channel"] == "10.1.2.3:7000" and params["p_tp_size"] == 4
            status, body = await c.admin("GET")
            assert sorted(i["url"] for i in body["instances"]) == sorted([d_new.url, p_new.url])
        finally:
            await d_new.stop()
            await p_new.stop()


async def test_removing_an_instance_lets_its_open_stream_finish():
    async with cluster(prefill=1, decode=2) as c:
        d0 = c.decodes[0]
        d0.chunk_gate = asyncio.Queue()
        async with c.client.post(c.url + "/v1/completions", json=completion(stream=True)) as resp:
            await resp.content.readline()
            assert (await c.admin("DELETE", {"url": d0.url}))[0] == 200
            assert (await c.post("/v1/completions", completion()))[0] == 200
            assert len(c.decodes[1].requests) == 1
            d0.chunk_gate.put_nowait(None)
            d0.chunk_gate.put_nowait(None)
            assert (await resp.content.read()).endswith(b"data: [DONE]\n\n")
        text = (await (await c.client.get(c.url + "/metrics")).text())
        assert d0.url not in text  # its series went with it


async def test_admin_added_instance_that_is_down_starts_ejected():
    async with cluster(prefill=1, decode=1) as c:
        status, body = await c.admin("POST", {"role": "decode", "url": "http://127.0.0.1:9"})
        assert status == 201 and body["healthy"] is False
        assert (await c.post("/v1/completions", completion()))[0] == 200
