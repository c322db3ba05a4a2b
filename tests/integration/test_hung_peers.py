"""Hung peers through the router: SIGSTOP of the whole P or D instance (API server, engine core,
workers) with requests in flight and more arriving, for less than the lease, more than the lease,
and more than D's watchdog, in push and in pull. Every request must be answered with monolithic's
tokens (D computes the prompt itself where the KV could not arrive), within the pause plus D's
bound (a P stopped longer than suspect_after_s: within seconds, while it is still stopped), and both instances must come back to no blocks in use and none held.

The cluster's own P and D are paused, behind a router of their own. Each scenario appends its row
to the file named by NEURON_DISAGG_FAULT_MATRIX when set (the table in docs/faults.md comes from
there)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from neuron_disagg import timeline  # noqa: E402
from neuron_disagg.local_cluster import free_port, router  # noqa: E402

from .fault_matrix import record  # noqa: E402
from .vllm_cluster import (  # noqa: E402
    D_BOUND_S, TIMEOUTS, body, kv_usage, metric, next_id, prompt, reference, run, wait_for,
)

pytestmark = pytest.mark.integration

PAUSES_S = {"shorter than the lease": TIMEOUTS["lease_s"] / 3,
            "longer than the lease": TIMEOUTS["lease_s"] * 1.5,
            "longer than the watchdog": TIMEOUTS["watchdog_s"] + 4}
EARLY, LATE = 2, 2  # requests sent just before the pause, and while the instance is stopped


@pytest.fixture(scope="module")
def hung(cluster):
    """The cluster's P and D behind a router of their own that checks health every second. The
    other tests' instances are the ones paused here: each scenario ends only once both serve again
    with nothing held, and a dedicated pair would cost two more vLLM starts."""
    r = router([(cluster.p.url, cluster.p_side)], [cluster.d.url], free_port(), secret=cluster.secret,
               extra_args=("--health-interval-s", "1", "--timeline-dir", cluster.timeline_dir)).start()
    try:
        r.wait_ready(60)
        yield {"prefill": cluster.p, "decode": cluster.d, "router": r, "timeline": cluster.timeline_dir}
    finally:
        for instance in (cluster.p, cluster.d):
            instance.resume()  # never leave a stopped group behind
        r.stop()


def _nothing_in_use(instance) -> bool:
    held = metric(instance, "neuron_disagg_held_blocks{")
    return kv_usage(instance) == 0.0 and held == 0


@pytest.mark.parametrize("pause", list(PAUSES_S))
@pytest.mark.parametrize("target", ["prefill", "decode"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_hung_instance_delays_answers_but_never_changes_or_loses_them(cluster, hung, mode, target, pause):
    paused_s = PAUSES_S[pause]
    texts = [prompt(150 + 20 * i, 300 + next_id()) for i in range(EARLY + LATE)]
    d = hung["decode"]
    recomputed_before = metric(d, "neuron_disagg_recomputed_total")

    async def scenario():
        async with httpx.AsyncClient(timeout=D_BOUND_S + paused_s + 120) as client:
            want = [await reference(cluster, client, t, 24) for t in texts]

            async def answered(text):
                response = await client.post(f"{hung['router'].url}/v1/completions",
                                             json=body(text, 24, disagg_mode=mode))
                return response, time.monotonic()

            def send(text):
                return asyncio.create_task(answered(text))

            tasks = [send(t) for t in texts[:EARLY]]
            await asyncio.sleep(0.05)
            hung[target].pause()
            stopped, stopped_at = time.monotonic(), time.time()
            try:
                await asyncio.sleep(0.5)
                tasks += [send(t) for t in texts[EARLY:]]
                await asyncio.sleep(paused_s - 0.5)
            finally:
                hung[target].resume()
            done = await asyncio.gather(*tasks)
            return want, [r for r, _ in done], max(at for _, at in done) - stopped, stopped_at

    want, answers, took, stopped_at = run(scenario())
    assert [a.status_code for a in answers] == [200] * len(texts), [a.text for a in answers if a.status_code != 200]
    got = [a.json()["choices"][0]["text"] for a in answers]
    bound = paused_s + D_BOUND_S + 10
    freed = wait_for(lambda: all(_nothing_in_use(hung[role]) for role in ("prefill", "decode")),
                     D_BOUND_S + TIMEOUTS["lease_s"], "P's and D's blocks back to none in use and none held")
    recomputed = int(metric(d, "neuron_disagg_recomputed_total") - recomputed_before)
    row = (f"| SIGSTOP {target} {paused_s:g} s ({pause}) | {mode} | {len(texts)} answered, "
           f"{recomputed} recomputed by D | last answer {took:.1f} s after the stop (bound {bound:.0f}) | "
           f"0 (back in {freed:.1f} s) | {'yes' if got == want else 'NO'} |")
    record(row)
    assert got == want, _mismatch_report(cluster, hung, texts, want, answers, stopped_at)
    assert took < bound, f"answers took {took:.1f} s after the pause began, bound {bound:.0f} s"
    wait_for(lambda: httpx.get(f"{hung['router'].url}/health", timeout=5).status_code == 200, 30,
             "the router seeing both instances healthy again")


def _mismatch_report(cluster, hung, texts, want, answers, stopped_at) -> str:
    """What tells a wrong answer's cause apart: the same prompt asked of P and of D directly (their
    own prefix caches then serve it: a differing answer there means the cached KV itself is wrong),
    and the transfer's timeline relative to the pause."""
    marks = timeline.load(hung["timeline"])
    lines = [f"pause began at {stopped_at:.3f}"]
    for i, (text, expected, answer) in enumerate(zip(texts, want, answers, strict=True)):
        got = answer.json()["choices"][0]["text"]
        if got == expected:
            continue
        lines.append(f"request {i} ({answer.json().get('id')}): got {got!r}, monolithic {expected!r}")
        for role in ("prefill", "decode"):
            direct = httpx.post(f"{hung[role].url}/v1/completions", json=body(text, 24), timeout=120)
            answered = direct.json()["choices"][0]["text"] if direct.status_code == 200 else direct.text[:200]
            lines.append(f"  asked of {role} directly: "
                         + ("monolithic's" if answered == expected else f"DIFFERENT ({direct.status_code}): {answered!r}"))
        hexes = set(re.findall(r"[0-9a-f]{32}", f"{answer.json().get('id')} {answer.headers.get('X-Request-Id')}"))
        for tid, events in marks.items():
            if any(h in tid for h in hexes):
                lines.append(f"  timeline {tid}: " + ", ".join(
                    f"{e} {at - stopped_at:+.3f}" for e, at in sorted(events.items(), key=lambda kv: kv[1])))
    return "\n".join(lines)
