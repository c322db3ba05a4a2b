"""Every row of the consumer's transition table, plus fencing (I2) and watchdog scenarios."""

import pytest

from neuron_disagg.protocol import (
    Cancel, CancelAck, ConsumerCore, ConsumerTimeouts, DState, FailTransfer, FinishLoad, FreeBlocks,
    Heartbeat, RankRegions, Registration, SendMessage, TransferId, WriteDone, WriteFailed,
)
from neuron_disagg.protocol.actions import Transitioned
from neuron_disagg.protocol.consumer import LATE_ALLOCATION, TABLE, DEffect, DEvent
from neuron_disagg.protocol.geometry import ModelShape, rank_regions

REGIONS = rank_regions(ModelShape(2, 2, 8, 2, 4), 16)
T = ConsumerTimeouts(watchdog_s=10, admission_timeout_s=20, heartbeat_interval_s=2, max_write_s=5,
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
}

EVENTS = {
    DEvent.EXPECT: lambda c, now: c.expect(TID, "p-host:1", 1, now),
    DEvent.ALLOCATED: lambda c, now: c.allocated(registration(), now),
    DEvent.DELIVERED: lambda c, now: c.verdict(WriteDone(TID, 0, 1), now),
    DEvent.UNDELIVERABLE: lambda c, now: c.verdict(WriteFailed(TID, 0, 1, "peer died"), now),
    DEvent.ABORT: lambda c, now: c.abort(TID, "client gone", now),
    DEvent.EXPIRED: lambda c, now: c.tick(c.entries[TID].deadline),  # just the next deadline
    DEvent.SUPERSEDED: lambda c, now: c.expect(TransferId("req", 1), "p-host:1", 1, now),
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
