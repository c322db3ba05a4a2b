"""Every row of the peer watch's table (protocol/liveness.py), and its clock: probes one at a time,
silence judged only from ticks the watch saw, ranks no transfer waits on forgotten."""

import pytest

from neuron_disagg.protocol.actions import ProbePeer
from neuron_disagg.protocol.liveness import TABLE, PEffect, PEvent, PeerWatch, PState

P = ("p-host:1", 0)
SUSPECT_S = 3.0


def _ticks(watch, start, end, every=0.05, wanted=frozenset({P})):
    probes, now = [], start
    while now <= end:
        probes += watch.tick(now, set(wanted))
        now = round(now + every, 6)
    return probes


def _reach(state):
    watch = PeerWatch(SUSPECT_S)
    watch.tick(0.0, {P})
    if state is PState.ALIVE:
        watch.answered(P, "first", 0.1)
    elif state is PState.GONE:
        watch.answered(P, "first", 0.1)
        watch.failed(P, True, 0.2)
    assert watch.state_of(P) is state
    return watch


def _event(watch, event):
    if event is PEvent.ANSWERED:
        return watch.answered(P, "first", 0.5)
    if event is PEvent.RESTARTED:
        return watch.answered(P, "second", 0.5)
    if event is PEvent.REFUSED:
        _ticks(watch, 0.3, 1.1)  # the next probe goes out
        return watch.failed(P, True, 1.2)
    _ticks(watch, 0.3, 0.3 + SUSPECT_S + 0.1)
    return {P: watch.gone()[P]} if watch.gone().get(P) and watch.state_of(P) is PState.GONE else {}


@pytest.mark.parametrize("state,event", sorted(TABLE, key=lambda k: (k[0].value, k[1].value)), ids=lambda v: v.name)
def test_every_peer_watch_row(state, event):
    rule = TABLE[(state, event)]
    watch = _reach(state)
    was_gone = state is PState.GONE
    suspected = _event(watch, event)
    if state is PState.UNKNOWN and event is PEvent.RESTARTED:
        assert watch.state_of(P) is PState.ALIVE and not suspected  # a first answer is never a restart
        return
    assert watch.state_of(P) is (rule.next_state or state)
    if PEffect.SUSPECT in rule.effects:
        assert P in suspected and suspected[P].endswith("(p-host:1 rank 0)"), suspected
    elif not was_gone:
        assert not suspected


def test_one_probe_is_out_at_a_time_and_they_go_a_third_of_suspect_after_s_apart():
    watch = PeerWatch(SUSPECT_S)
    assert watch.tick(0.0, {P}) == [ProbePeer(*P)]
    watch.answered(P, "first", 0.2)
    assert _ticks(watch, 0.25, 0.95) == []
    assert watch.tick(1.0, {P}) == [ProbePeer(*P)]
    assert _ticks(watch, 1.05, 2.5) == [], "unanswered: no second probe"
    watch.answered(P, "first", 2.5)
    assert watch.tick(2.55, {P}) == [ProbePeer(*P)], "overdue: at once"


def test_a_long_gap_between_ticks_is_our_own_pause_not_the_peers_silence():
    watch = PeerWatch(SUSPECT_S)
    watch.tick(0.0, {P})
    _ticks(watch, 10.0, 10.0 + SUSPECT_S - 0.05)
    assert watch.state_of(P) is PState.UNKNOWN
    _ticks(watch, 10.0 + SUSPECT_S, 10.0 + SUSPECT_S)
    assert watch.state_of(P) is PState.GONE


def test_a_rank_no_transfer_waits_on_is_forgotten_and_starts_afresh():
    watch = _reach(PState.GONE)
    watch.tick(1.0, set())
    assert watch.state_of(P) is None and watch.gone() == {}
    assert watch.tick(1.1, {P}) == [ProbePeer(*P)]
    assert watch.state_of(P) is PState.UNKNOWN


def test_answers_and_failures_for_ranks_not_watched_change_nothing():
    watch = PeerWatch(SUSPECT_S)
    assert watch.answered(P, "x", 0.0) == {} and watch.failed(P, True, 0.0) == {}
    assert watch.state_of(P) is None


def test_a_probe_that_timed_out_is_not_a_refusal_silence_decides():
    watch = _reach(PState.ALIVE)
    _ticks(watch, 0.2, 1.2)
    assert watch.failed(P, False, 1.25) == {} and watch.state_of(P) is PState.ALIVE
