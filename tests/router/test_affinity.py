"""Routing by what instances hold: the bounded-load choice (``selection.py``), where the router learns
what each instance holds (``affinity.py``), the events socket (``kv_events.py``), and a router in
front of fake instances sending a conversation's turns where its earlier turns went."""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_disagg.config import Config, ConfigError
from neuron_disagg.router.affinity import Affinity
from neuron_disagg.router.instances import Instance
from neuron_disagg.router.kv_events import EventListener
from neuron_disagg.router.prefix_index import BlockStored, EventBatch
from neuron_disagg.router.selection import Hits, pick_decode, pick_prefill
from neuron_disagg.vllm.serve import build_command

from .conftest import cluster, completion

BLOCK = 4
PROMPT = list(range(100, 116))  # four blocks


def published(url: str, seq: int, *events) -> list[bytes]:
    """One message as vLLM's publisher frames it: topic, 8-byte sequence number, the batch."""
    batch = EventBatch(time.time(), [msgspec.Raw(msgspec.msgpack.encode(e)) for e in events])
    return [url.encode(), seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def stored(tokens, hashes, parent=None) -> BlockStored:
    return BlockStored(list(hashes), parent, list(tokens), BLOCK)


def instances(role: str, n: int) -> list[Instance]:
    return [Instance(role, f"http://10.0.0.{i}:8000", f"10.0.0.{i}:5600") for i in range(n)]  # type: ignore[arg-type]


# -- the choice -----------------------------------------------------------------------------------
def test_a_prompt_goes_to_the_instance_that_holds_it_while_that_keeps_it_within_the_load_bound():
    p0, p1 = instances("prefill", 2)
    hits = Hits(1000, lambda i: 800 if i is p1 else 0, epsilon=0.25)
    assert pick_prefill([p0, p1], hits) is p1
    p1.in_flight, p1.prompt_tokens = 2, 2000  # above (1.25 x the mean) with one more: the bound wins
    assert pick_prefill([p0, p1], hits) is p0
    assert pick_prefill([p0, p1]) is p0  # without hits: load alone

    d0, d1 = instances("decode", 2)
    hits = Hits(1000, lambda i: 960 if i is d1 else 0, epsilon=0.25)
    d1.in_flight = 1
    assert pick_decode([d0, d1], 0.0, 30.0, 0.95, hits=hits) is d1  # holds it, and 2 <= ceil(1.25 x 2 / 2)
    assert pick_decode([d0, d1], 0.0, 30.0, 0.95) is d0
    d1.in_flight = 3
    assert pick_decode([d0, d1], 0.0, 30.0, 0.95, hits=hits) is d0


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 6), epsilon=st.sampled_from([0.0, 0.1, 0.25, 0.5]), legs=st.integers(1, 200),
       holder=st.integers(0, 5))
def test_one_hot_prefix_never_takes_an_instance_above_the_bound(n, epsilon, legs, holder):
    """Every request holds the same prefix, which one instance holds at first and every instance
    picked comes to hold; open legs pile up (none ends), the worst case for the bound."""
    pool = instances("prefill", n)
    holders = {pool[holder % n]}
    for _ in range(legs):
        hits = Hits(1000, lambda i: 992 if i in holders else 0, epsilon)
        chosen = pick_prefill(pool, hits)
        mean_before = sum(i.in_flight for i in pool) / n
        chosen.in_flight += 1
        chosen.prompt_tokens += 1000 - hits.held(chosen)
        holders.add(chosen)
        assert chosen.in_flight <= math.ceil((1 + epsilon) * (mean_before * n + 1) / n)
    loads = [i.in_flight for i in pool]
    assert max(loads) <= (1 + epsilon) * (sum(loads) / n) + 1


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_at_light_load_one_hot_prefix_takes_no_more_than_its_bounded_share_of_the_legs(role):
    """Each leg ends before the next arrives (nothing runs for long), every prompt holds the same
    prefix, and the instance first picked holds it: the window of recent legs is what bounds it."""
    from neuron_disagg.router.pool import InstancePool

    pool = InstancePool()
    members = [pool.add(inst) for inst in instances(role, 2)]
    holders: set[Instance] = set()
    for n in range(120):
        hits = Hits(1000, lambda i: 992 if i in holders else 0, epsilon=0.25, window_s=30.0)
        chosen = pool.pick(role, 1000.0 + n * 0.5, hits=hits)  # 2 legs a second, each over at once
        holders.add(chosen)
    legs = [len(i.picked_at) for i in members]
    assert max(legs) / (sum(legs) / 2) <= 1.3, legs
    assert len(holders) == 2  # it spilled, and the second came to hold it too


# -- where the router learns it -------------------------------------------------------------------
def test_an_instance_that_publishes_is_matched_by_its_events_and_one_that_stops_while_working_by_history():
    url, now = "http://10.0.0.1:8000", 100.0
    a = Affinity(BLOCK, events_stale_s=5.0, history_ttl_s=60.0)
    keys = a.keys(PROMPT)
    assert a.received(published(url, 0, stored(PROMPT[:8], [b"a", b"b"])), {url}, now) == url
    assert (a.source(url), a.hit_blocks(url, keys, now)) == ("events", 2)
    a.routed(url, keys, now)  # sent there: history says all four
    a.leg_ended(url, now + 4)
    assert (a.source(url), a.hit_blocks(url, keys, now + 4)) == ("events", 2)  # events still rule
    a.leg_ended(url, now + 6)  # worked 6 s after its last batch: its publisher is gone
    assert (a.source(url), a.hit_blocks(url, keys, now + 6)) == ("history", 4)
    assert a.index.blocks(url) == 0  # what its events fed is forgotten
    assert a.hit_blocks(url, keys, now + 61) == 0  # history expires too
    a.received(published(url, 1, stored(PROMPT[:4], [b"a"])), {url}, now + 70)
    assert (a.source(url), a.hit_blocks(url, keys, now + 70)) == ("events", 1)  # heard again


def test_a_publisher_that_restarts_forgets_what_it_held_and_skipped_batches_are_counted():
    url = "http://10.0.0.1:8000"
    a = Affinity(BLOCK)
    keys = a.keys(PROMPT)
    a.received(published(url, 0, stored(PROMPT[:8], [b"a", b"b"])), {url}, 1.0)
    a.received(published(url, 3, stored(PROMPT[8:12], [b"c"], b"b")), {url}, 1.1)
    assert a.hit_blocks(url, keys, 1.1) == 3 and a.missed[url] == 2
    a.received(published(url, 0, stored(PROMPT[:4], [b"x"])), {url}, 2.0)  # numbered from 0 again
    assert a.hit_blocks(url, keys, 2.0) == 1 and a.restarts[url] == 1


def test_messages_from_a_topic_naming_no_instance_or_with_bad_frames_are_rejected_and_counted():
    url = "http://10.0.0.1:8000"
    a = Affinity(BLOCK)
    assert a.received(published("http://10.9.9.9:8000", 0, stored(PROMPT[:4], [b"a"])), {url}, 1.0) is None
    assert a.received([b"x", b"short", b"y"], {url}, 1.0) is None
    assert a.received([url.encode()], {url}, 1.0) is None
    assert a.received([url.encode(), (5).to_bytes(8, "big"), b"\xc1garbage"], {url}, 1.0) == url
    assert (a.rejected + a.index.rejected) == {"unknown_topic": 1, "bad_frames": 2, "malformed": 1}
    assert a.index.blocks("http://10.9.9.9:8000") == 0


async def test_the_router_hears_a_publisher_that_connects_to_its_endpoint_and_serves_the_counts():
    """A ZMQ PUB connecting as vLLM's publisher does to an endpoint without a wildcard."""
    from neuron_disagg.local_cluster import free_port

    url = "http://127.0.0.1:8000"
    a = Affinity(BLOCK)
    heard: list[str | None] = []
    listener = EventListener(f"127.0.0.1:{free_port()}", a, lambda: {url}, heard.append)
    listener.start()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.connect(listener.endpoint)
    try:
        seq = 0
        while not heard:  # a PUB drops what it sends before the connection is up
            pub.send_multipart(published(url, seq, stored(PROMPT[:4], [f"h{seq}".encode()])))
            seq += 1
            await asyncio.sleep(0.05)
        assert heard[0] == url and a.source(url) == "events" and a.hit_blocks(url, a.keys(PROMPT), 0.0) == 1
    finally:
        pub.close(linger=0)
        await listener.close()


def test_a_second_router_on_the_same_events_endpoint_fails_saying_where():
    from neuron_disagg.local_cluster import free_port

    async def main():
        endpoint = f"127.0.0.1:{free_port()}"
        first = EventListener(endpoint, Affinity(BLOCK), set)
        first.start()
        try:
            with pytest.raises(OSError, match=f"KV events on tcp://{endpoint}"):
                EventListener(endpoint, Affinity(BLOCK), set).start()
        finally:
            await first.close()
    asyncio.run(main())


# -- the deployment config ------------------------------------------------------------------------
def test_serve_makes_each_instance_publish_to_the_router_under_its_own_url():
    config = Config.from_mapping({"kv_events_endpoint": "10.0.0.4:5570", "side_channel_host": "10.0.0.7"})
    command = build_command("prefill", "m", config, ["--port", "8100"])
    events = msgspec.json.decode(command[command.index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.0.0.4:5570",
                      "topic": "http://10.0.0.7:8100"}
    command = build_command("decode", "m", config, ["--host", "127.0.0.1", "--port=8200"])
    assert "http://127.0.0.1:8200" in command[command.index("--kv-events-config") + 1]
    assert "--kv-events-config" not in build_command("decode", "m", Config(), [])
    mine = build_command("decode", "m", config, ["--kv-events-config", "{}"])
    assert mine.count("--kv-events-config") == 1  # the user's own wins


@pytest.mark.parametrize("endpoint", ["*:5570", "0.0.0.0:5570", "[::1]:5570", "10.0.0.4", "10.0.0.4:0"])
def test_an_events_endpoint_that_would_make_instances_listen_or_names_no_port_fails_at_startup(endpoint):
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        Config.from_mapping({"kv_events_endpoint": endpoint})


# -- a router in front of fake instances ----------------------------------------------------------
def turns(n: int) -> list[list[int]]:
    """A conversation's prompts as token ids: each turn the previous prompt plus 40 new tokens."""
    prompt: list[int] = list(range(1000, 1064))
    out = []
    for t in range(n):
        prompt = prompt + list(range(2000 + 40 * t, 2040 + 40 * t))
        out.append(prompt)
    return out


async def test_a_conversations_turns_follow_its_first_turn_to_the_same_p_and_d_without_events():
    async with cluster(prefill=2, decode=2, block_size=16) as c:
        for prompt in turns(3):  # turn by turn, the conversations interleaved
            for conversation in range(2):
                status, _, _ = await c.post("/v1/completions", completion([conversation] + prompt[1:]))
                assert status == 200
        by_conversation: dict[int, set[str]] = {0: set(), 1: set()}
        for fake in c.prefills + c.decodes:
            for rec in fake.requests:
                by_conversation[rec.body["prompt"][0]].add(fake.name)
        assert [len(names) for names in by_conversation.values()] == [2, 2]  # one P and one D each
        assert by_conversation[0] != by_conversation[1]  # and the two conversations spread out
        metrics = await (await c.client.get(c.url + "/metrics")).text()
        url = c.prefills[0].url
        assert f'neuron_disagg_router_prefix_source{{source="history",url="{url}"}} 1.0' in metrics


async def test_without_prefix_routing_a_conversations_turns_go_by_load_alone():
    async with cluster(prefill=2, decode=2, block_size=16, prefix_routing=False) as c:
        for prompt in turns(4):
            await c.post("/v1/completions", completion(prompt))
        assert all(len(fake.requests) == 2 for fake in c.prefills)  # idle P's take turns


def test_prompt_ids_are_the_ids_given_or_the_text_tokenized_and_none_where_the_router_cannot_know_them():
    pytest.importorskip("transformers", reason="the router's --tokenizer needs transformers (installed with vLLM)")
    from neuron_disagg.demo import tiny_model
    from neuron_disagg.router.prompt_ids import PromptIds
    from neuron_disagg.router.requests import parse_client_request

    def req(path: str, **body):
        return parse_client_request(path, msgspec.json.encode({"model": "m", **body}), "push")

    ids = PromptIds(str(tiny_model.build()))
    assert ids.ids(req("/v1/completions", prompt=[5, 6, 7])) == [5, 6, 7]
    text = ids.ids(req("/v1/completions", prompt="river mountain ocean"))
    assert text and all(type(t) is int for t in text)
    chat = ids.ids(req("/v1/chat/completions", messages=[{"role": "user", "content": "river mountain ocean"}]))
    assert chat and chat != text  # the template's role and generation prompt around it
    for unknown in (req("/v1/completions", prompt=["a", "b"]), req("/v1/completions", prompt="a", cache_salt="s")):
        assert ids.ids(unknown) is None
    assert PromptIds().ids(req("/v1/completions", prompt="river")) is None  # no tokenizer: text unknown
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        PromptIds("/nonexistent/tokenizer")
