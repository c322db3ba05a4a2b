"""Every row of the consumer's transition table, plus fencing (I2) and watchdog scenarios."""

import pytest

from neuron_disagg.protocol import (
    Cancel, CancelAck, ConsumerCore, ConsumerTimeouts, DState, FailTransfer, FinishLoad, FreeBlocks,
    Heartbeat, RankRegions, Registration, SendMessage, TransferId, WriteDone, WriteFailed,
)
from neuron_disagg.protocol.actions import ProbePeer, Quarantine, Transitioned
from neuron_disagg.protocol.consumer import LATE_ALLOCATION, TABLE, DEffect, DEvent
from neuron_disagg.protocol.geometry import ModelShape, rank_regions

REGIONS = rank_regions(ModelShape(2, 2, 8, 2, 4), 16)
T = ConsumerTimeouts(watchdog_s=10, admission_timeout_s=20, heartbeat_interval_s=2, max_write_s=5, suspect_after_s=3,
                     clock_skew_allowance_s=1, tombstone_s=100)
TID = TransferId("req", 0)
DST = (7, 8, 9)


def registration(tid=TID):
    return Registration(tid, "d", "d-req", "d-host:1", 1, (RankRegions(0, "d0", REGIONS),), DST, 0, 0.0)


def core(tp_rank=0, tp_size=1):
    return ConsumerCore("d-host:1", tp_rank, tp_size, timeouts=T, strict=True)


PATHS = {
    DState.NEW: [],
    DState.PENDING: [lambda c: c.expect(TID, "p-host:1", 1, 0)],
    DState.REGISTERED: [lambda c: c.expect(TID, "p-host:1", 1, 0), lambda c: c.allocated(registration(), 1)],
    DState.CANCELLING: [lambda c: c.expect(TID, "p-host:1", 1, 0), lambda c: c.allocated(registration(), 1),
                        lambda c: c.abort(TID, "client gone", 2)],
    DState.TIMING_OUT: [lambda c: c.expect(TID, "p-host:1", 1, 0), lambda c: c.allocated(registration(), 1),
                        lambda c: c.tick(11)],
    DState.DONE: [lambda c: c.expect(TID, "p-host:1", 1, 0), lambda c: c.allocated(registration(), 1),
                  lambda c: c.verdict(WriteDone(TID, 0, 1), 2)],
    DState.FAILED: [lambda c: c.expect(TID, "p-host:1", 1, 0), lambda c: c.allocated(registration(), 1),
                    lambda c: c.verdict(WriteFailed(TID, 0, 1, "boom"), 2)],
    DState.CANCELLED: [lambda c: c.expect(TID, "p-host:1", 1, 0), lambda c: c.abort(TID, "gone", 1)],
    DState.QUARANTINED: [lambda c: c.expect(TID, "p-host:1", 1, 0), lambda c: c.allocated(registration(), 1),
                         lambda c: _suspect(c, 2)],
}


def _suspect(c, now):
    """P's rank refuses our probe: it is gone."""
    return c.tick(now) + c.probe_failed("p-host:1", 0, True, now)


EVENTS = {
    DEvent.EXPECT: lambda c, now: c.expect(TID, "p-host:1", 1, now),
    DEvent.ALLOCATED: lambda c, now: c.allocated(registration(), now),
    DEvent.DELIVERED: lambda c, now: c.verdict(WriteDone(TID, 0, 1), now),
    DEvent.UNDELIVERABLE: lambda c, now: c.verdict(WriteFailed(TID, 0, 1, "peer died"), now),
    DEvent.ABORT: lambda c, now: c.abort(TID, "client gone", now),
    DEvent.EXPIRED: lambda c, now: c.tick(c.entries[TID].deadline),  # just the next deadline
    DEvent.SUPERSEDED: lambda c, now: c.expect(TransferId("req", 1), "p-host:1", 1, now),
    DEvent.SUSPECTED: _suspect,
}


def _reach(state, c=None):
    c = c or core()
    for step in PATHS[state]:
        step(c)
    assert c.state_of(TID) is (None if state is DState.NEW else state)
    return c


ROWS = sorted((k for k in TABLE if k[1] is not DEvent.VERDICT), key=lambda k: (k[0].value, k[1].value))


@pytest.mark.parametrize("state,event", ROWS, ids=lambda v: v.name)
def test_every_table_row(state, event):
    if state is DState.NEW and event is DEvent.SUPERSEDED:
        c = core()
        c.expect(TransferId("req", 1), "p-host:1", 1, 0)
        c.expect(TID, "p-host:1", 1, 1)  # a stale attempt arrives after a newer one
        assert c.state_of(TID) is DState.CANCELLED
        return
    rule = TABLE[(state, event)]
    c = _reach(state)
    actions = EVENTS[event](c, 3.0)
    assert c.state_of(TID) is (rule.next_state or state)
    kinds = [type(a) for a in actions]
    sent = [a.message for a in actions if isinstance(a, SendMessage)]
    for effect in rule.effects:
        if effect is DEffect.SEND_REGISTRATION:
            assert any(isinstance(m, Registration) and m.expires_at == 3.0 + T.watchdog_s for m in sent)
        elif effect is DEffect.SEND_CANCEL:
            assert any(isinstance(m, Cancel) and m.d_side_channel == "d-host:1" for m in sent)
        elif effect is DEffect.FINISH_LOAD:
            assert FinishLoad in kinds
        elif effect is DEffect.FREE_BLOCKS:
            assert FreeBlocks(TID, DST) in actions
        elif effect is DEffect.FREE_LATE_BLOCKS:  # the blocks just allocated, never registered
            assert FreeBlocks(TID, registration().block_ids) in actions
        elif effect is DEffect.FAIL:
            assert FailTransfer in kinds
        elif effect is DEffect.ARM_FENCE:
            assert c.entries[TID].deadline == 1 + T.watchdog_s + 2 * T.max_write_s + T.clock_skew_allowance_s
        elif effect is DEffect.DROP:
            assert any(k.startswith("dropped") for k in c.counters)
        elif effect is DEffect.QUARANTINE:
            quarantined = [a for a in actions if isinstance(a, Quarantine)]
            assert len(quarantined) == 1 and "refused the connection" in quarantined[0].reason, actions
        elif effect is DEffect.COUNT_LATE_LANDING:
            assert c.counters["landed_in_quarantine"] == 1
    if not {DEffect.FREE_BLOCKS, DEffect.FREE_LATE_BLOCKS} & set(rule.effects):
        assert FreeBlocks not in kinds, "blocks freed by a row that does not free"
    if FailTransfer in kinds and FreeBlocks in kinds:  # the worker reports a load when its blocks are freed
        assert kinds.index(FailTransfer) < kinds.index(FreeBlocks), actions


def test_partial_verdicts_keep_waiting_for_every_writer():
    """D rank 0 of TP 1 receives from both ranks of a TP-2 prefill: one verdict is not enough."""
    c = core()
    c.expect(TID, "p-host:1", 2, 0)
    c.allocated(registration(), 1)
    assert c.verdict(WriteDone(TID, 0, 2), 2) == []
    assert c.state_of(TID) is DState.REGISTERED
    assert c.verdict(WriteDone(TID, 0, 2), 2) == []  # a duplicate is not a second writer
    assert c.counters["dropped:writedone:registered"] == 1
    actions = c.verdict(WriteDone(TID, 1, 2), 3)
    assert FinishLoad(TID) in actions and c.state_of(TID) is DState.DONE


def test_one_failed_writer_waits_for_the_other_before_freeing():
    c = core()
    c.expect(TID, "p-host:1", 2, 0)
    c.allocated(registration(), 1)
    assert c.verdict(WriteFailed(TID, 0, 2, "nic down"), 2) == []  # rank 1 may still be writing
    actions = c.verdict(WriteDone(TID, 1, 2), 3)
    assert FreeBlocks(TID, DST) in actions
    assert FailTransfer(TID, "nic down") in actions


def test_watchdog_fails_within_bound_and_frees_only_after_the_fence():
    c = _reach(DState.REGISTERED)
    actions = c.tick(1 + T.watchdog_s)
    assert any(isinstance(a, SendMessage) and isinstance(a.message, Cancel) for a in actions)
    assert not any(isinstance(a, FreeBlocks) for a in actions)
    fence = 1 + T.watchdog_s + 2 * T.max_write_s + T.clock_skew_allowance_s
    assert not any(isinstance(a, FreeBlocks) for a in c.tick(fence - 0.01))
    actions = c.tick(fence)
    assert FreeBlocks(TID, DST) in actions
    assert any(isinstance(a, FailTransfer) and "watchdog_s" in a.reason for a in actions)


def test_abort_after_registering_fences_blocks_until_cancel_ack():
    c = _reach(DState.CANCELLING)
    assert c.tick(3) == [] or not any(isinstance(a, FreeBlocks) for a in c.tick(3))
    actions = c.verdict(CancelAck(TID, 0, 1), 4)
    assert actions[-1] == FreeBlocks(TID, DST)
    assert c.state_of(TID) is DState.CANCELLED


def test_late_write_done_while_timing_out_still_delivers():
    c = _reach(DState.TIMING_OUT)
    actions = c.verdict(WriteDone(TID, 0, 1), 12)
    assert FinishLoad(TID) in actions and not any(isinstance(a, FreeBlocks) for a in actions)


def test_heartbeats_name_the_transfer_and_stop_after_registration_ends():
    c = core()
    c.expect(TID, "p-host:1", 2, 0)
    beats = [a for a in c.tick(0) if isinstance(a, SendMessage)]
    assert [(a.peer, a.ranks, a.message) for a in beats] == [("p-host:1", (0, 1), Heartbeat(TID, 0))]
    assert c.tick(1) == []
    assert len(c.tick(2)) == 1
    c.abort(TID, "gone", 3)
    assert c.tick(10) == []


def test_verdicts_for_unknown_or_pending_transfers_are_dropped():
    c = core()
    c.verdict(WriteDone(TransferId("ghost"), 0, 1), 0)
    c.expect(TID, "p-host:1", 1, 0)
    c.verdict(WriteDone(TID, 0, 1), 1)  # nothing was registered yet: not owed
    assert c.state_of(TID) is DState.PENDING
    assert c.counters["dropped:writedone:unknown"] == 1
    assert c.counters["dropped:writedone:pending"] == 1


def test_wrong_p_tp_size_is_not_a_verdict():
    c = _reach(DState.REGISTERED)
    c.verdict(WriteDone(TID, 0, 4), 2)
    assert c.state_of(TID) is DState.REGISTERED


def test_blocks_allocated_after_the_transfer_ended_fail_their_load_at_once_and_go_back():
    """A second engine request of the same prompt and kv_transfer_params, allocated after the first
    one's transfer ended: before, the core ignored it and the request waited for ever with its
    blocks (seen in CI). Now its load fails at once (D computes the prompt) and only its own blocks
    are freed; nothing goes to P. The same for a transfer never expected or long forgotten."""
    c = _reach(DState.DONE)
    c.expect(TID, "p-host:1", 1, 4)
    late = Registration(TID, "d", "d-req-2", "d-host:1", 1, (RankRegions(0, "d0", REGIONS),), (3, 4), 0, 0.0)
    actions = [a for a in c.allocated(late, 5) if not isinstance(a, Transitioned)]
    assert actions == [FailTransfer(TID, LATE_ALLOCATION), FreeBlocks(TID, (3, 4))]
    assert c.state_of(TID) is DState.DONE
    never = TransferId("never-expected", 0)
    assert core().allocated(registration(never), 1) == [FailTransfer(never, LATE_ALLOCATION), FreeBlocks(never, DST)]


def test_admission_timeout_fails_and_tells_p():
    c = _reach(DState.PENDING)
    actions = c.tick(T.admission_timeout_s)
    assert any(isinstance(a, FailTransfer) and "admission_timeout_s" in a.reason for a in actions)
    assert any(isinstance(a, SendMessage) and isinstance(a.message, Cancel) for a in actions)


# -- a prefill that is gone: the request goes on now, the blocks wait for their fence ----------------
FENCE = 1 + T.watchdog_s + 2 * T.max_write_s + T.clock_skew_allowance_s  # registered at 1


def _ticks(c, start, end, every=0.05):
    """The receiver's ticks from ``start`` to ``end``: every action they returned."""
    actions, now = [], start
    while now <= end:
        actions += c.tick(now)
        now = round(now + every, 6)
    return actions


def test_a_prefill_that_refuses_our_probe_is_quarantined_at_once_and_its_blocks_wait_for_the_fence():
    c = _reach(DState.REGISTERED)
    probes = [a for a in c.tick(1.0) if isinstance(a, ProbePeer)]
    assert probes == [ProbePeer("p-host:1", 0)]
    actions = c.probe_failed("p-host:1", 0, True, 1.2)
    assert [a for a in actions if isinstance(a, Quarantine)] == [Quarantine(TID, actions[-1].reason)]
    assert "refused" in actions[-1].reason and c.state_of(TID) is DState.QUARANTINED
    assert any(isinstance(a, SendMessage) and isinstance(a.message, Cancel) for a in actions)
    assert not [a for a in actions + _ticks(c, 1.25, FENCE - 0.05) if isinstance(a, (FreeBlocks, FailTransfer))]
    assert FreeBlocks(TID, DST) in c.tick(FENCE)
    assert c.state_of(TID) is DState.FAILED and c.counters["quarantined"] == 1


def test_a_silent_prefill_is_suspected_after_suspect_after_s_and_not_before():
    c = _reach(DState.REGISTERED)
    early = _ticks(c, 1.0, 1.0 + T.suspect_after_s - 0.05)
    assert not [a for a in early if isinstance(a, Quarantine)]
    assert len([a for a in early if isinstance(a, ProbePeer)]) == 1, "one probe out at a time"
    actions = c.tick(1.0 + T.suspect_after_s)
    assert [a.reason for a in actions if isinstance(a, Quarantine)] == [
        "prefill silent: no answer to a probe within suspect_after_s (p-host:1 rank 0)"]


def test_a_prefill_that_answers_is_never_suspected_however_long_its_prefill():
    c = _reach(DState.REGISTERED)
    now = 1.0
    while now < 1 + T.watchdog_s - 0.1:
        for probe in [a for a in c.tick(now) if isinstance(a, ProbePeer)]:
            assert not c.probe_answered(probe.peer, probe.rank, "p-1", now + 0.01)
        now = round(now + 0.05, 6)
    assert c.state_of(TID) is DState.REGISTERED


def test_our_own_pause_is_not_taken_for_a_silent_prefill():
    """D's process was stopped (or starved) for longer than suspect_after_s with a probe out: the
    silence is D's own, so nothing is suspected until P has had suspect_after_s to answer since."""
    c = _reach(DState.REGISTERED)
    c.tick(1.0)  # a probe goes out; D stops right after
    resumed = 1.0 + 2 * T.suspect_after_s
    assert not [a for a in _ticks(c, resumed, resumed + T.suspect_after_s - 0.05) if isinstance(a, Quarantine)]
    assert [a for a in c.tick(resumed + T.suspect_after_s) if isinstance(a, Quarantine)]


def test_a_prefill_restarted_at_its_address_quarantines_what_the_old_one_held():
    c = _reach(DState.REGISTERED)
    c.tick(1.0)
    assert c.probe_answered("p-host:1", 0, "first", 1.1) == []
    c.tick(1.0 + T.suspect_after_s / 3)
    actions = c.probe_answered("p-host:1", 0, "second", 2.2)
    assert [a.reason for a in actions if isinstance(a, Quarantine)] == [
        "prefill restarted: a new process answers at its address (p-host:1 rank 0)"]
    # A transfer that starts with the new process is not suspected.
    new = TransferId("req-2", 0)
    c.expect(new, "p-host:1", 1, 2.3)
    c.allocated(registration(new), 2.4)
    c.tick(2.5)
    assert c.state_of(new) is DState.REGISTERED


def test_a_late_write_into_quarantined_blocks_is_counted_and_never_handed_to_decode():
    """A P that was only paused resumes and delivers: the request already went on without the
    KV, so the landing frees the blocks early and nothing is decoded from them."""
    c = _reach(DState.QUARANTINED)
    actions = c.verdict(WriteDone(TID, 0, 1), 4)
    assert FreeBlocks(TID, DST) in actions and FinishLoad(TID) not in actions
    assert not [a for a in actions if isinstance(a, (FailTransfer, Quarantine))], "the request was told once"
    assert c.counters["landed_in_quarantine"] == 1 and c.state_of(TID) is DState.FAILED


def test_a_transfer_waiting_for_blocks_whose_prefill_is_gone_fails_and_its_blocks_are_refused_later():
    c = _reach(DState.PENDING)
    c.tick(0.5)
    actions = c.probe_failed("p-host:1", 0, True, 0.6)
    assert any(isinstance(a, FailTransfer) and "refused" in a.reason for a in actions)
    late = [a for a in c.allocated(registration(), 0.7) if not isinstance(a, Transitioned)]
    assert late == [FailTransfer(TID, LATE_ALLOCATION), FreeBlocks(TID, DST)]


def test_a_transfer_that_starts_waiting_on_a_prefill_already_gone_recovers_at_the_next_tick():
    c = _reach(DState.REGISTERED)
    c.tick(1.0)
    c.probe_failed("p-host:1", 0, True, 1.1)
    new = TransferId("req-2", 0)
    c.expect(new, "p-host:1", 1, 1.2)
    c.allocated(registration(new), 1.3)
    assert [a.transfer_id for a in c.tick(1.35) if isinstance(a, Quarantine)] == [new]


def test_a_registration_that_never_reached_prefill_frees_its_blocks_at_once_quarantined_or_not():
    """The send to P's rank failed, so P never acts on it: no write can come, no fence is needed."""
    c = _reach(DState.REGISTERED)
    actions = c.undelivered(TID, 0, "ConnectionRefusedError: refused", 1.1)
    assert [type(a) for a in actions if isinstance(a, (FailTransfer, FreeBlocks))] == [FailTransfer, FreeBlocks]
    assert "never reached prefill rank 0" in c.entries[TID].reason
    q = _reach(DState.QUARANTINED)
    assert FreeBlocks(TID, DST) in q.undelivered(TID, 0, "refused", 2.1)
    assert q.state_of(TID) is DState.FAILED
    assert core().undelivered(TID, 0, "refused", 1) == []  # nothing registered: nothing to say


def test_a_registration_undelivered_to_one_prefill_rank_still_waits_for_the_other():
    c = core()
    c.expect(TID, "p-host:1", 2, 0)
    c.allocated(registration(), 1)
    assert not [a for a in c.undelivered(TID, 0, "refused", 1.1) if isinstance(a, FreeBlocks)]
    assert c.state_of(TID) is DState.REGISTERED  # rank 1 may be writing
