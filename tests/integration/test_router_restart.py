"""The router restarted with requests in flight, through real vLLM (the shared cluster): kill -9 of
the router while push and pull requests, streamed and not, are being served, then a new router on
its port. The router holds no KV and no state P or D need: what must hold is that every client gets
an answer or an error (never a hang), that P and D give back every block within D's bound plus the
lease, and that the new router serves monolithic's answers at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from neuron_disagg.local_cluster import free_port, router  # noqa: E402

from .fault_matrix import record  # noqa: E402
from .vllm_cluster import D_BOUND_S, TIMEOUTS, body, kv_usage, metric, prompt, reference, run, wait_for  # noqa: E402

pytestmark = pytest.mark.integration

SHAPES = [("push", False), ("pull", False), ("push", True), ("pull", True)]


def _nothing_in_use(instance) -> bool:
    return kv_usage(instance) == 0.0 and metric(instance, "neuron_disagg_held_blocks{") == 0


def test_a_router_killed_with_requests_in_flight_leaves_nothing_held_and_a_new_one_serves(cluster):
    port = free_port()

    def start_router():
        return router([(cluster.p.url, cluster.p_side)], [cluster.d.url], port, secret=cluster.secret).start()

    texts = [prompt(300 + 30 * i, 700 + i) for i in range(len(SHAPES))]
    first = start_router().wait_ready(60)
    try:
        async def scenario():
            async with httpx.AsyncClient(timeout=D_BOUND_S + 60) as client:
                async def send(text, mode, stream):
                    try:
                        return await client.post(f"{first.url}/v1/completions",
                                                 json=body(text, 1000, disagg_mode=mode, stream=stream))
                    except httpx.TransportError as exc:  # the router's end of the connection is gone
                        return exc

                tasks = [asyncio.create_task(send(t, m, s)) for t, (m, s) in zip(texts, SHAPES, strict=True)]
                # In flight: D holds blocks for them (allocated, being written, or decoding).
                await asyncio.to_thread(wait_for, lambda: kv_usage(cluster.d) > 0, 30, "D serving the requests")
                first.kill()
                killed = time.monotonic()
                outcomes = await asyncio.gather(*tasks)
                return outcomes, time.monotonic() - killed

        outcomes, answered_s = run(scenario())
    finally:
        first.stop()
    errors = [o for o in outcomes if isinstance(o, Exception)]
    assert errors, f"every request had finished before the kill: {outcomes}"
    assert all(isinstance(o, httpx.TransportError) or o.status_code == 200 for o in outcomes), outcomes
    assert answered_s < 10, f"clients waited {answered_s:.1f} s after the kill"
    bound = D_BOUND_S + TIMEOUTS["lease_s"]
    freed = wait_for(lambda: _nothing_in_use(cluster.p) and _nothing_in_use(cluster.d), bound,
                     "P's and D's blocks back to none in use and none held")

    second = start_router().wait_ready(60)  # the same port, as a supervisor would restart it
    try:
        async def after():
            async with httpx.AsyncClient(timeout=120) as client:
                want = [await reference(cluster, client, t, 16) for t in texts]
                answers = await asyncio.gather(*(client.post(f"{second.url}/v1/completions",
                                                             json=body(t, 16, disagg_mode=m))
                                                 for t, (m, _) in zip(texts, SHAPES, strict=True)))
            return want, answers

        want, answers = run(after())
    finally:
        second.stop()
    assert [a.status_code for a in answers] == [200] * len(texts), [a.text for a in answers]
    got = [a.json()["choices"][0]["text"] for a in answers]
    row = (f"| router kill -9 with {len(texts)} requests in flight, then a new router | push and pull | "
           f"{len(errors)} errors, {len(texts) - len(errors)} answered | {answered_s:.1f} s to every client's "
           f"outcome | 0 (back in {freed:.1f} s, bound {bound:.0f}) | {'yes' if got == want else 'NO'} (new router) |")
    record(row)
    assert got == want
