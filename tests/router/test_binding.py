"""The binding horizon: push sends P's leg at arrival and chooses D, from its load then, when P's
predicted remaining time falls to ``bind_horizon_ms`` (``router/binding.py``)."""

from __future__ import annotations

import asyncio

import pytest

from neuron_disagg.config import ConfigError
from neuron_disagg.local_cluster import free_port
from neuron_disagg.protocol import Withdraw, WireCodec
from neuron_disagg.router.binding import PrefillPace, bind_at
from neuron_disagg.router.cli import build
from neuron_disagg.router.settings import RouterSettings

from neuron_disagg.transfer.side_channel import SideChannelServer

from .conftest import cluster, completion, until
from .fakes import SECRET


def _metric(c, name: str, **labels: str) -> float:
    return c.router.metrics.registry.get_sample_value(name, labels) or 0.0


# -- the pace and the bind time, pure ----------------------------------------------------------------
def test_a_prefill_without_a_measured_pace_predicts_nothing_and_its_legs_bind_when_it_answers():
    pace = PrefillPace()
    assert pace.dispatch(now=10.0, tokens=100) is None
    assert bind_at(None, 0.2, arrived=10.0) is None
    assert bind_at(None, None, arrived=10.0) == 10.0  # no horizon: at arrival, as before


def test_the_pace_is_measured_from_answers_and_legs_queue_first_come_first_served():
    pace = PrefillPace()
    pace.answered(sent=0.0, now=1.0, tokens=100, predicted=None)  # 10 ms a token
    assert pace.seconds_per_token == pytest.approx(0.01)
    first = pace.dispatch(now=2.0, tokens=100)
    second = pace.dispatch(now=2.0, tokens=50)  # behind the first
    assert (first, second) == (pytest.approx(3.0), pytest.approx(3.5))
    # The first answered early: the second's prediction moves up by as much; the service time
    # counted for it starts at the first's answer, not at its own dispatch.
    pace.answered(sent=2.0, now=2.6, tokens=100, predicted=first)
    assert pace.busy_until == pytest.approx(3.1)
    pace.answered(sent=2.0, now=3.1, tokens=50, predicted=3.1)
    assert pace.seconds_per_token == pytest.approx(0.8 * (0.8 * 0.01 + 0.2 * 0.006) + 0.2 * 0.01)


def test_a_failed_leg_frees_the_time_predicted_for_it():
    pace = PrefillPace(seconds_per_token=0.01)
    predicted = pace.dispatch(now=0.0, tokens=100)
    pace.ended(now=0.2, predicted=predicted)
    assert pace.busy_until == pytest.approx(0.2)
    assert pace.seconds_per_token == 0.01  # a failure measures nothing


def test_d_is_bound_the_horizon_before_the_predicted_answer_and_never_before_arrival():
    assert bind_at(5.0, 0.5, arrived=1.0) == 4.5
    assert bind_at(1.2, 0.5, arrived=1.0) == 1.0


def test_a_horizon_of_zero_waits_for_p_s_answer_whatever_the_prediction():
    assert bind_at(5.0, 0.0, arrived=1.0) is None  # a P answering later than predicted must not see D first


def test_the_horizon_is_arrival_or_milliseconds_and_anything_else_fails_at_start(monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", "s" * 32)
    assert build(["--bind-horizon-ms", "arrival"])[0].bind_horizon_ms is None
    assert build(["--bind-horizon-ms", "250"])[0].bind_horizon_ms == 250
    with pytest.raises(SystemExit):
        build(["--bind-horizon-ms", "soon"])
    with pytest.raises(ConfigError, match="bind_horizon_ms"):
        RouterSettings.build(bind_horizon_ms=-1)


# -- through the router, against scripted instances --------------------------------------------------
async def _held_at_p(c, what: str = "P's leg", **body) -> asyncio.Task:
    """A request sent while the first P holds its answer; returns once P has its leg."""
    p = c.prefills[0]
    p.hold = asyncio.Event()
    task = asyncio.create_task(c.post("/v1/completions", completion(**body)))
    count = len(p.requests)
    await until(lambda: len(p.requests) > count, what)
    return task


async def test_with_a_horizon_of_zero_d_gets_its_leg_only_after_p_answered():
    async with cluster(prefill=1, decode=1, mode="push", bind_horizon_ms=0) as c:
        p, d = c.prefills[0], c.decodes[0]
        task = await _held_at_p(c)
        await asyncio.sleep(0.3)
        assert not d.requests, "D was chosen at arrival although a horizon is set"
        p.hold.set()
        status, _, answer = await task
        assert status == 200 and answer["choices"][0]["text"] == "hello world", answer
        assert d.requests[0].params["transfer_id"] == p.requests[0].transfer_id
        # P's pace is measured now; a P slower than predicted still answers before D is chosen.
        task = await _held_at_p(c, "the second P leg")
        await asyncio.sleep(0.6)  # well past the prediction from the first (held 0.3 s)
        assert len(d.requests) == 1, "a horizon of 0 trusted the prediction over P's answer"
        p.hold.set()
        assert (await task)[0] == 200


async def test_a_decode_instance_that_failed_during_the_prefill_is_not_chosen():
    async with cluster(prefill=1, decode=2, mode="push", bind_horizon_ms=0) as c:
        p, (d0, d1) = c.prefills[0], c.decodes
        task = await _held_at_p(c)  # at arrival D0 was the choice (ties in list order)
        c.router.pool.set_health(c.instance(d0), False)  # as its health checks would, once it stopped
        p.hold.set()
        status, _, answer = await task
        assert status == 200, answer
        assert not d0.requests and len(d1.requests) == 1


async def test_a_decode_instance_stopped_during_the_prefill_is_not_chosen():
    """Stopped, not dead (SIGSTOP, a hung host): nothing refuses a connection, its health checks only
    time out, and it would be ejected seconds later. Its unanswered check makes it silent at once."""
    async with cluster(prefill=1, decode=2, mode="push", bind_horizon_ms=0, health_interval_s=0.1,
                       decode_silent_s=0.3) as c:
        p, (d0, d1) = c.prefills[0], c.decodes
        task = await _held_at_p(c)  # at arrival D0 was the choice (ties in list order)
        d0.awake.clear()
        await asyncio.sleep(0.6)  # a check sent since went unanswered for longer than decode_silent_s
        assert c.instance(d0).healthy  # not ejected: its checks have not even timed out
        p.hold.set()
        await until(lambda: d1.requests, "D's leg on D1, the D still answering")
        assert (await task)[0] == 200
        assert _metric(c, "neuron_disagg_router_decode_legs_total", url=d0.url) == 0
        d0.awake.set()


async def test_the_decode_balance_is_recorded_as_each_decode_leg_goes_out():
    async with cluster(prefill=1, decode=2, mode="push") as c:
        c.decodes[0].hold = asyncio.Event()  # D0 keeps its first request running
        first = asyncio.create_task(c.post("/v1/completions", completion()))
        await until(lambda: c.decodes[0].requests, "D0's leg")
        assert (await c.post("/v1/completions", completion()))[0] == 200  # to D1: one running on each side
        assert c.decodes[1].requests
        c.decodes[0].hold.set()
        assert (await first)[0] == 200
    count = _metric(c, "neuron_disagg_router_decode_imbalance_count", mode="push")
    evenly = _metric(c, "neuron_disagg_router_decode_imbalance_bucket", mode="push", le="1.0")
    # The first leg went out to two idle D's (nothing to weigh); the second saw 1 and 0 running: 2.
    assert (count, evenly) == (1, 0)
    assert _metric(c, "neuron_disagg_router_decode_imbalance_sum", mode="push") == 2.0


async def test_with_a_measured_pace_d_is_bound_before_p_answers_but_not_at_arrival():
    async with cluster(prefill=1, decode=1, mode="push", bind_horizon_ms=500) as c:
        p, d = c.prefills[0], c.decodes[0]
        first = await _held_at_p(c, "the first P leg")
        await asyncio.sleep(1.2)  # P's pace: about 1.2 s for this prompt
        p.hold.set()
        assert (await first)[0] == 200
        waited_before = _metric(c, "neuron_disagg_router_bind_wait_seconds_sum", mode="push")  # the first's
        second = await _held_at_p(c, "the second P leg")
        await until(lambda: len(d.requests) == 2, "the second D leg, before P answers", timeout_s=10)
        # The router's own wait from dispatch (a timer never fires early): the horizon is 0.5 s
        # before a prefill measured at 1.2 s or more, so at least 0.7 s; at arrival it would be 0.
        waited = _metric(c, "neuron_disagg_router_bind_wait_seconds_sum", mode="push") - waited_before
        assert waited >= 0.6, f"bound after {waited:.3f} s: at arrival, not at the horizon"
        assert p.requests[1].finished_at is None  # P still computing: D bound ahead of it
        p.hold.set()
        assert (await second)[0] == 200
        assert _metric(c, "neuron_disagg_router_prefill_prediction_error_seconds_count") == 1


async def test_a_prefill_that_fails_before_d_is_bound_is_retried_and_no_decode_leg_is_wasted():
    async with cluster(prefill=2, decode=1, mode="push", bind_horizon_ms=0) as c:
        (p0, p1), d = c.prefills, c.decodes[0]
        p0.fail_status = 500
        task = await _held_at_p(c, "attempt 0 on P0")
        p0.hold.set()
        status, _, answer = await task
        assert status == 200, answer
        assert len(d.requests) == 1 and d.requests[0].params["transfer_id"] == p1.requests[0].transfer_id


async def test_no_healthy_decode_at_bind_time_fails_clearly_and_tells_p():
    codec, port = WireCodec(SECRET), free_port()
    got: list = []
    server = SideChannelServer("127.0.0.1", port, codec, got.append).start()
    try:
        async with cluster(prefill=1, decode=1, mode="push", bind_horizon_ms=0, codec=codec,
                           p_side_channel=(f"127.0.0.1:{port}", 1)) as c:
            p, d = c.prefills[0], c.decodes[0]
            task = await _held_at_p(c)
            c.router.pool.set_health(c.instance(d), False)
            p.hold.set()
            status, _, answer = await task
            assert status == 503 and answer["error"]["code"] == "no_decode_instance", answer
            assert not d.requests
            await until(lambda: got, "P's Withdraw: it frees the prompt's KV now, not at its lease's end")
            assert isinstance(got[0], Withdraw) and "no decode instance" in got[0].reason
    finally:
        server.close()


async def test_a_client_gone_before_d_is_bound_cancels_p_at_once():
    async with cluster(prefill=1, decode=1, mode="push", bind_horizon_ms=0) as c:
        p, d = c.prefills[0], c.decodes[0]
        task = await _held_at_p(c, stream=True)
        task.cancel()
        await until(lambda: p.requests[0].cancelled, "P to see its leg closed")
        assert not d.requests
        await until(lambda: all(i.in_flight == 0 and i.prompt_tokens == 0 for i in c.router.pool.all()),
                    "the router's leases to be released")
