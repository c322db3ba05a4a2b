"""Routing by what instances hold, through real vLLM instances publishing their KV events to the router
(the shared cluster's P and D, as ``serve`` configures them from ``kv_events_endpoint``)."""

from __future__ import annotations

import time

import httpx
import pytest

from .vllm_cluster import BLOCK_SIZE, body, explained, metric, prompt, reference, run, wait_for


def router_series(routed, name: str, **labels: str) -> float:
    """One series of the router's /metrics (0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(f"{routed.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"neuron_disagg_router_{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _reference(cluster, text: str, max_tokens: int) -> str:
    async with httpx.AsyncClient(timeout=120) as client:
        return await reference(cluster, client, text, max_tokens)


def vllm_hits(instance) -> float:
    return metric(instance, "vllm:prefix_cache_hits_total")


def events_heard(routed, instance) -> None:
    """Until the router hears ``instance``'s events: a ZMQ publisher that connected drops the first
    message it sends (it takes in the router's subscription only as it sends), so a fresh instance's
    first batch never arrives. Plain requests under a salt of their own, which nothing else hits."""
    def heard() -> bool:
        salt = f"warm-{time.monotonic_ns()}"
        r = httpx.post(f"{instance.url}/v1/completions", json=body(prompt(80, 7), 1, cache_salt=salt), timeout=60)
        assert r.status_code == 200, r.text
        time.sleep(0.2)
        return router_series(routed, "prefix_source", url=instance.url, source="events") == 1.0
    wait_for(heard, 30, f"the router hearing {instance.name}'s KV events")


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_routers_match_is_vllms_own_prefix_cache_hit_on_p_and_on_d(cluster, routed, mode):
    """A conversation's second turn (the first turn's prompt and more) is matched by the router, from
    the events P and D published after the first, exactly as far as vLLM's own prefix cache hits it:
    the router tokenizes and chains as vLLM does (a different tokenization or block chain fails here).
    The answer is monolithic's."""
    # A conversation of its own: an instance that already holds a prompt stores (and tells) nothing new
    # of it, and other tests send these words too.
    first = f"conversation {time.time_ns()} {mode}: " + prompt(240, 3)
    second = first + " and then " + prompt(60, 5)
    tokens = httpx.post(f"{cluster.p.url}/tokenize", json={"model": "tiny", "prompt": first}, timeout=30).json()["count"]
    for inst in (cluster.p, cluster.d):
        events_heard(routed, inst)
    blocks = {inst.url: router_series(routed, "prefix_indexed_blocks", url=inst.url) for inst in (cluster.p, cluster.d)}
    with explained(cluster):
        r = httpx.post(f"{routed.url}/v1/completions", json=body(first, 4, disagg_mode=mode), timeout=120)
        assert r.status_code == 200, r.text
        for inst in (cluster.p, cluster.d):  # the first turn's blocks, as each one's events told the router
            wait_for(lambda: router_series(routed, "prefix_indexed_blocks", url=inst.url)
                     >= blocks[inst.url] + tokens // BLOCK_SIZE - 1, 20, f"{inst.name}'s KV events at the router")
        before = {role: router_series(routed, "prefix_held_tokens_total", role=role) for role in ("prefill", "decode")}
        hits = {inst.name: vllm_hits(inst) for inst in (cluster.p, cluster.d)}
        r = httpx.post(f"{routed.url}/v1/completions", json=body(second, 8, disagg_mode=mode), timeout=120)
        assert r.status_code == 200, r.text
        matched = {role: router_series(routed, "prefix_held_tokens_total", role=role) - before[role]
                   for role in ("prefill", "decode")}
        assert matched["prefill"] >= (tokens // BLOCK_SIZE - 1) * BLOCK_SIZE  # nearly all the first turn
        for inst, role in ((cluster.p, "prefill"), (cluster.d, "decode")):
            wait_for(lambda: vllm_hits(inst) - hits[inst.name] == matched[role], 10,
                     f"{inst.name}'s own prefix cache hit ({vllm_hits(inst) - hits[inst.name]:.0f} tokens) "
                     f"equal to the router's match ({matched[role]:.0f})")
        # P computed and D registered only what they lacked: still monolithic's answer
        assert r.json()["choices"][0]["text"] == run(_reference(cluster, second, 8))
