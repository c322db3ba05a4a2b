"""Ray Serve LLM as the engine in front: a real local Ray cluster (`neuron-disagg
ray-serve`, Ray 2.60 on vLLM 0.29) serving P and D replicas with our connector through Ray's OpenAI
app, push at /push (peer-bound, concurrent hand-off) and pull at /pull (sequential).

Each answer is token-equal to a monolithic vLLM 0.29; the KV moved (our counters on the replicas,
as Ray exports them); every replica's held blocks return to none; n > 1 and prompt lists work as
through our router; and a P replica killed mid-request still yields the answer, D computing it."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time

import httpx
import pytest

from neuron_disagg.demo import tiny_model
from neuron_disagg.local_cluster import descendants, monolithic, free_port, stop_together

from ..vllm_envs import extra_env
from .fault_matrix import record
from .ray_cluster import MODES, REPLICAS, RayCluster
from .vllm_cluster import MAX_MODEL_LEN, TIMEOUTS, body, prompt, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.vllm_servers]


@pytest.fixture(scope="module")
def ray_cluster():
    model = str(tiny_model.build())
    mono = monolithic(model, free_port(), "0", python=extra_env("0.29.0").python, max_model_len=MAX_MODEL_LEN)
    config = TIMEOUTS
    ray = RayCluster(model, secrets.token_hex(32), config)
    try:
        ray.driver.start()
        mono.start()
        mono.wait_ready()
        ray.driver.wait_ready()
        yield ray, mono
    finally:
        stop_together([ray.driver, mono], timeout_s=15)  # then SIGKILL, replicas' groups too: Ray's own shutdown takes ~40 s


def test_the_cluster_listens_on_loopback_only_but_where_ray_hard_codes_every_interface(ray_cluster):
    """This machine's rule, and what a single-node user expects: a local cluster's daemons, its
    workers and the vLLM engines in its replicas listen on 127.0.0.1 alone (by default Ray and vLLM
    bind the node's address: neuron_disagg.ray_serve.app makes both loopback). Ray 2.60 hard-codes
    one exception: each Serve replica's gRPC server, for calls between deployments, binds every
    interface ("[::]:0", ray/serve/_private/replica.py), behind Ray's token authentication."""
    ray, _ = ray_cluster
    listening = ray.listeners()
    for process in ("gcs_server", "raylet", "ray::ServeReplica:", "VLLM::Worker"):
        assert any(process in title for _, _, title in listening), f"no {process} seen listening: {listening}"
    wide = [(ip, port, title) for ip, port, title in listening if ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")
            and not (ip == "::" and title.startswith("ray::ServeReplica:"))]
    assert not wide, f"listening beyond loopback: {wide}"


def answers(url: str, bodies: list[dict], path: str = "/v1/completions") -> list[dict]:
    async def send():
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(client.post(url + path, json=b) for b in bodies))

    out = asyncio.run(send())
    assert all(r.status_code == 200 for r in out), [r.text for r in out]
    return [r.json() for r in out]


def texts(answer: dict) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in answer["choices"]]


def test_push_and_pull_through_ray_equal_monolithic_and_move_the_kv(ray_cluster):
    ray, mono = ray_cluster
    prompts = [prompt(40, 301), prompt(300, 302), prompt(120, 303)]
    want = [texts(a) for a in answers(mono.url, [body(p, 16) for p in prompts])]
    assert all(len(set(w[0])) > 4 for w in want), f"the tiny model must not repeat one token: {want}"
    loaded = ray.total("neuron_disagg_transfers_total", "decode")
    for mode in MODES:
        got = [texts(a) for a in answers(ray.app_url(mode), [body(p, 16) for p in prompts])]
        assert got == want, mode
        streamed = _streamed(ray.app_url(mode), body(prompts[1], 16, stream=True))
        assert streamed == want[1][0], mode
    # Each of 2 modes x 4 requests moved its prompt's KV into a D replica (none recomputed).
    wait_for(lambda: ray.total("neuron_disagg_transfers_total", "decode") >= loaded + 8, 60,
             "D replicas counting 8 loaded transfers")
    assert ray.total("neuron_disagg_recomputed_total", "decode") == 0
    assert ray.total("neuron_disagg_params_rejected_total", "prefill") == 0
    ray.held_blocks_back()


def _streamed(url: str, request: dict) -> str:
    import json

    text = []
    with httpx.stream("POST", url + "/v1/completions", json=request, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def test_chat_n_and_prompt_lists_through_ray_as_through_our_router(ray_cluster):
    ray, mono = ray_cluster
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt(60, 311)}], "temperature": 0,
            "max_tokens": 12}
    listed = body([prompt(30, 312), prompt(90, 313), prompt(30, 312)], 10)
    sampled = body(prompt(50, 314), 10, n=3, temperature=0.8, seed=7)  # greedy refuses n > 1
    want_chat = texts(answers(mono.url, [chat], "/v1/chat/completions")[0])
    want_list, want_n = (texts(a) for a in answers(mono.url, [listed, sampled]))
    replayed = ray.total("neuron_disagg_params_replayed_total", "prefill")
    loaded = ray.total("neuron_disagg_transfers_total", "decode")
    for mode in MODES:
        url = ray.app_url(mode)
        assert texts(answers(url, [chat], "/v1/chat/completions")[0]) == want_chat, mode
        got_list, got_n = (texts(a) for a in answers(url, [listed, sampled]))
        assert got_list == want_list and got_n == want_n, mode
    assert ray.total("neuron_disagg_params_replayed_total", "prefill") == replayed  # siblings, not replays
    # Per mode: chat 1, the list's 2 distinct prompts, the sampled prompt 1 (its 3 samples share it).
    wait_for(lambda: ray.total("neuron_disagg_transfers_total", "decode") >= loaded + 8, 60,
             "D replicas counting 8 loaded transfers")
    ray.held_blocks_back()


def test_p_replicas_killed_mid_request_still_yield_the_answer(ray_cluster):
    """Each mode's P replica dies with a request in flight, as a crashed host's would: its vLLM
    engine is stopped (SIGSTOP: nothing it computes can land) while the replica itself still takes
    requests, the requests are sent, and once they were dispatched the replica is killed with its
    engine (SIGKILL to its process group). The client still gets monolithic's answer, in seconds:
    under push, D registered with the P whose probes then go unanswered or refused, gives the load
    up and computes the prompt itself (counted; before, at its watchdog, 26.8 s after registering);
    under pull, D computes it or a P replica Ray started meanwhile serves the leg. No replica holds a
    block after. The test does not wait for Ray's new P replicas (two vLLM starts, about 80 s of
    the suite's critical path): that a D reaches a P restarted at the same side-channel address is
    tested on real processes in test_upstream_restarts.py and tests/transfer/test_side_channel.py.
    Last in this module: the fixture then stops the cluster, restarting replicas included."""
    ray, mono = ray_cluster
    text = prompt(600, 320)
    want = texts(answers(mono.url, [body(text, 8)])[0])
    replicas = [pid for mode in MODES for pid in _p_replica_pids(ray, mode)]
    assert len(replicas) == REPLICAS * len(MODES), replicas
    engines = [pid for replica in replicas for pid, _ in descendants(replica)]
    assert engines, "no engine processes below the P replicas"
    recomputed = ray.total("neuron_disagg_recomputed_total", "decode")

    async def kill_in_flight():
        async with httpx.AsyncClient(timeout=300) as client:
            for pid in engines:
                os.kill(pid, signal.SIGSTOP)
            requests = [asyncio.create_task(client.post(ray.app_url(mode) + "/v1/completions", json=body(text, 8)))
                        for mode in MODES]
            # Dispatched by then: Ray picked the P replica (it still answers), P's leg waits on
            # the stopped engine, D's registration sits in the stopped worker's socket.
            await asyncio.sleep(3.0)
            for pid in replicas:
                os.killpg(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
            killed = time.monotonic()
            answered = await asyncio.gather(*requests)
            return answered, time.monotonic() - killed

    answered, took = asyncio.run(kill_in_flight())
    for mode, r in zip(MODES, answered, strict=True):
        assert r.status_code == 200, (mode, r.text)
        assert texts(r.json()) == want, mode
    record(f"| Ray Serve LLM: each mode's P replica stopped, then killed, with a request in flight | push and pull | "
           f"2 answered, monolithic's tokens | {took:.1f} s after the kill (before: 26.8 s after registering, "
           f"D's watchdog and fence) | 0 | yes |")
    assert took < TIMEOUTS["watchdog_s"], f"answered {took:.1f} s after the kill: D waited for its watchdog"
    wait_for(lambda: ray.total("neuron_disagg_recomputed_total", "decode") > recomputed, 60,
             "push's D replica counting the recompute")
    ray.held_blocks_back(120)


def _p_replica_pids(ray: RayCluster, mode: str) -> list[int]:
    return ray.replica_processes(f"neuron-disagg-{mode}:Prefill")
