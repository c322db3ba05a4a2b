"""vLLM 0.24.0 — the Neuron plugin of SDK 2.32 runs on it — end to end: its P and D servers (from
the environment set-up builds, tests/vllm_envs.py), push legs sent directly, push and pull through
the router; every answer token-equal to D computing the prompt alone (under a cache salt, so none
of the KV it was sent: one 0.24 start fewer than a monolithic server of its own), and P's and D's
held blocks back to none. (0.29 and 0.32 run the whole of test_vllm_push.py against monolithic.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ..vllm_envs import extra_env
from .vllm_cluster import _compare, blocks_back, body, handed_over_early, metric, prompt, reference, run, running
from .vllm_cluster import routed as routed_by_router

pytestmark = [pytest.mark.integration, pytest.mark.vllm_servers, pytest.mark.extended]
VERSION = "0.24.0"


@pytest.fixture(scope="module")
def cluster():
    with running(extra_env(VERSION), reference_from_decode=True) as c:
        yield c


def test_push_legs_sent_directly_equal_d_alone(cluster):
    want, got = run(_compare(cluster, [prompt(3, 81), prompt(70, 82), prompt(400, 83)]))
    assert all(len(set(w)) > 4 for w in want), f"the tiny model must not repeat one token: {want}"
    assert got == want
    blocks_back(cluster)


def test_push_and_pull_through_the_router_equal_d_alone(cluster):
    texts = [prompt(45, 84), prompt(260, 85)]

    async def scenario(url):
        async with httpx.AsyncClient(timeout=120) as client:
            want = [await reference(cluster, client, t) for t in texts]
            got = {}
            for mode in ("push", "pull"):
                answers = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body(t, disagg_mode=mode))
                                                 for t in texts))
                assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
                got[mode] = [a.json()["choices"][0]["text"] for a in answers]
        return want, got

    early = metric(cluster.p, "neuron_disagg_early_hand_offs_total")
    with routed_by_router(cluster) as router:
        want, got = run(scenario(router.url))
    assert got == {"push": want, "pull": want}
    handed_over_early(cluster, early, 2)
    blocks_back(cluster)
