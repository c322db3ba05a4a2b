"""Every row of pull mode's two tables (protocol/lender.py, protocol/reader.py) and the lease/fence
arithmetic."""

import msgspec
import pytest

from neuron_disagg.protocol import FailTransfer, FinishLoad, FreeBlocks, RankRegions, SendMessage, TransferId
from neuron_disagg.protocol.geometry import ModelShape, rank_regions
from neuron_disagg.protocol.messages import PullOffer, ReadDone, ReadFailed
from neuron_disagg.protocol.actions import AbortRead, Quarantine, SubmitRead
from neuron_disagg.protocol import lender as lending, reader as reading
from neuron_disagg.protocol.lender import LenderCore, LenderTimeouts, LEvent, LState
from neuron_disagg.protocol.reader import ReaderCore, ReaderTimeouts, REffect, REvent, RState

REGIONS = rank_regions(ModelShape(2, 2, 8, 2, 4), 16)
TID = TransferId("req")
P_BLOCKS, D_BLOCKS = (1, 2, 3), (7, 8, 9)


def offer(tid=TID, expires_at=10.0, p_tp=1):
    ranks = tuple(RankRegions(r, f"p{r}", rank_regions(ModelShape(2, 2, 8, 2, 4), 16, r, p_tp)) for r in range(p_tp))
    return PullOffer(tid, "p", "p-host:1", p_tp, ranks, P_BLOCKS, expires_at)


def lender():
    return LenderCore(0, 1, LenderTimeouts(max_read_s=2, clock_skew_allowance_s=0.5), strict=True)


def reader(tp_rank=0, tp_size=1):
    return ReaderCore(tp_rank, tp_size, ReaderTimeouts(max_read_s=2), strict=True)


LOCAL = RankRegions(0, "d0", REGIONS)

L_PATHS = {
    LState.NEW: [],
    LState.HELD: [lambda c: c.offer(offer(), 0)],
    LState.RELEASED: [lambda c: c.offer(offer(), 0), lambda c: c.confirmed(ReadDone(TID, 0, 1), 1)],
    LState.EXPIRED: [lambda c: c.offer(offer(), 0), lambda c: c.tick(12.5)],
}
L_EVENTS = {
    LEvent.OFFER: lambda c: c.offer(offer(), 2),
    LEvent.CONFIRMED: lambda c: c.confirmed(ReadDone(TID, 0, 2), 2),  # 1 of 2 D ranks
    LEvent.ALL_CONFIRMED: lambda c: c.confirmed(ReadFailed(TID, 0, 1, "gave up"), 2),
    LEvent.ABORT: lambda c: c.abort(TID, "shutdown", 2),
    LEvent.EXPIRED: lambda c: c.tick(12.5),
    LEvent.SUPERSEDED: lambda c: c.offer(offer(TransferId("req", 1)), 2),
    LEvent.WITHDRAWN: lambda c: c.withdraw(TransferId("req", 0), "decode refused it", 2),
}


@pytest.mark.parametrize("state,event", sorted(lending.TABLE, key=lambda k: (k[0].value, k[1].value)),
                         ids=lambda v: v.name)
def test_every_lender_row(state, event):
    rule = lending.TABLE[(state, event)]
    c = lender()
    for step in L_PATHS[state]:
        step(c)
    if state is LState.NEW and event is LEvent.SUPERSEDED:
        c.offer(offer(TransferId("req", 1)), 0)
        actions = c.offer(offer(), 1)  # an older attempt's offer: nobody will read it
        assert c.state_of(TID) is LState.RELEASED and FreeBlocks(TID, P_BLOCKS) in actions
        return
    actions = L_EVENTS[event](c)
    if state is LState.NEW:
        assert c.state_of(TID) is (rule.next_state or state)
        return
    if event is LEvent.OFFER and state in (LState.RELEASED, LState.EXPIRED):
        assert FreeBlocks(TID, P_BLOCKS) in actions
        return
    if (state, event) in ((LState.RELEASED, LEvent.CONFIRMED), (LState.EXPIRED, LEvent.CONFIRMED),
                          (LState.RELEASED, LEvent.ALL_CONFIRMED), (LState.EXPIRED, LEvent.ALL_CONFIRMED)):
        assert any(k.startswith("dropped") for k in c.counters)  # late confirmations are counted
    assert c.state_of(TID) is (rule.next_state or state)
    assert (FreeBlocks(TID, P_BLOCKS) in actions) == ("FREE_BLOCKS" in [e.name for e in rule.effects])


def test_a_withdraw_frees_an_offer_nobody_will_read_now_or_as_it_is_made():
    c = lender()
    held, later, other = TransferId("req", 0, "aaa"), TransferId("req", 0, "bbb"), TransferId("req", 1, "ccc")
    c.offer(offer(held), 0)
    c.offer(offer(other), 0)
    freed = [a for a in c.withdraw(TransferId("req"), "decode refused it", 1) if isinstance(a, FreeBlocks)]
    assert freed == [FreeBlocks(held, P_BLOCKS)]
    assert c.state_of(held) is LState.RELEASED and c.state_of(other) is LState.HELD
    assert FreeBlocks(later, P_BLOCKS) in c.offer(offer(later), 2)
    assert c.state_of(later) is LState.RELEASED


def test_lender_waits_for_every_reading_rank_and_frees_once():
    c = lender()
    c.offer(offer(), 0)
    assert c.confirmed(ReadDone(TID, 0, 2), 1) == []
    assert c.confirmed(ReadDone(TID, 0, 2), 1) == []  # duplicate
    assert c.counters["dropped:readdone:not_owed"] == 1
    actions = c.confirmed(ReadDone(TID, 1, 2), 2)
    assert [a for a in actions if isinstance(a, FreeBlocks)] == [FreeBlocks(TID, P_BLOCKS)]
    assert c.tick(100) == []


def test_lender_lease_outlasts_any_read():
    c = lender()
    c.offer(offer(expires_at=10.0), 0)
    assert not [a for a in c.tick(12.49) if isinstance(a, FreeBlocks)]  # 10 + max_read 2 + skew 0.5
    actions = c.tick(12.5)
    assert FreeBlocks(TID, P_BLOCKS) in actions
    assert any(isinstance(a, FailTransfer) and "lease" in a.reason for a in actions)


R_PATHS = {
    RState.NEW: [],
    RState.WAITING: [lambda c: c.offered(offer(), 0)],
    RState.READING: [lambda c: c.offered(offer(), 0), lambda c: c.allocated(TID, LOCAL, D_BLOCKS, 0, 1)],
    RState.ABORTING: [lambda c: c.offered(offer(), 0), lambda c: c.allocated(TID, LOCAL, D_BLOCKS, 0, 1),
                      lambda c: c.abort(TID, "client gone", 1.5)],
    RState.DRAINING: [lambda c: c.offered(offer(), 0), lambda c: c.allocated(TID, LOCAL, D_BLOCKS, 0, 1),
                      lambda c: c.tick(3)],  # posted at 1, max_read_s 2
    RState.DONE: [lambda c: c.offered(offer(), 0), lambda c: c.allocated(TID, LOCAL, D_BLOCKS, 0, 1),
                  lambda c: c.read_done(TID, 1.5)],
    RState.FAILED: [lambda c: c.offered(offer(), 0), lambda c: c.allocated(TID, LOCAL, D_BLOCKS, 0, 1),
                    lambda c: c.read_failed(TID, "peer died", 1.5)],
    RState.CANCELLED: [lambda c: c.offered(offer(), 0), lambda c: c.abort(TID, "client gone", 1)],
    RState.QUARANTINED: [lambda c: c.offered(offer(), 0), lambda c: c.allocated(TID, LOCAL, D_BLOCKS, 0, 1),
                         lambda c: _suspect(c, 1.2)],
}


def _suspect(c, now):
    """P's rank refuses our probe: it is gone."""
    return c.tick(now) + c.probe_failed("p-host:1", 0, True, now)

R_EVENTS = {
    REvent.OFFER: lambda c: c.offered(offer(), 1.8),
    REvent.ALLOCATED: lambda c: c.allocated(TID, LOCAL, D_BLOCKS, 0, 1.8),
    REvent.READ_DONE: lambda c: c.read_done(TID, 1.8),
    REvent.READ_FAILED: lambda c: c.read_failed(TID, "remote disconnected", 1.8),
    REvent.ABORT: lambda c: c.abort(TID, "client gone", 1.8),
    REvent.EXPIRED: lambda c: c.tick(c.entries[TID].deadline),
    REvent.SUPERSEDED: lambda c: c.offered(offer(TransferId("req", 1)), 1.8),
    REvent.SUSPECTED: lambda c: _suspect(c, 1.8),
}
R_ACTIONS = {REffect.SUBMIT_READ: SubmitRead, REffect.ABORT_READ: AbortRead, REffect.FINISH_LOAD: FinishLoad,
             REffect.FAIL: FailTransfer, REffect.TELL_P_FAILED: SendMessage, REffect.FREE_BLOCKS: FreeBlocks,
             REffect.FREE_LATE_BLOCKS: FreeBlocks, REffect.QUARANTINE: Quarantine}


@pytest.mark.parametrize("state,event", sorted(reading.TABLE, key=lambda k: (k[0].value, k[1].value)),
                         ids=lambda v: v.name)
def test_every_reader_row(state, event):
    rule = reading.TABLE[(state, event)]
    c = reader()
    for step in R_PATHS[state]:
        step(c)
    if state is RState.NEW:
        c.offered(offer(TransferId("req", 1)), 0)
        c.offered(offer(), 1)
        assert c.state_of(TID) is RState.CANCELLED
        return
    actions = R_EVENTS[event](c)
    assert c.state_of(TID) is (rule.next_state or state)
    kinds = {type(a) for a in actions}
    for effect in rule.effects:
        if effect in R_ACTIONS:
            assert R_ACTIONS[effect] in kinds, (effect, actions)
    if REffect.FREE_BLOCKS not in rule.effects and REffect.FREE_LATE_BLOCKS not in rule.effects:
        assert FreeBlocks not in kinds
    if REffect.COUNT_LATE_LANDING in rule.effects:
        assert c.counters["landed_in_quarantine"] == 1
    if state is RState.QUARANTINED:
        assert FailTransfer not in kinds and Quarantine not in kinds, "the request was told once"
    order = [type(a) for a in actions if isinstance(a, (FailTransfer, FreeBlocks))]
    if FailTransfer in order and FreeBlocks in order:
        # The worker reports a transfer to vLLM when its blocks are freed: as a failed load only
        # if the failure came first. The other order decoded a load that never landed (CI, pull).
        assert order.index(FailTransfer) < order.index(FreeBlocks), actions


def test_reader_starts_no_read_on_an_expired_offer():
    c = reader()
    c.offered(offer(expires_at=5.0), 0)
    actions = c.allocated(TID, LOCAL, D_BLOCKS, 0, 5.0)
    assert not any(isinstance(a, SubmitRead) for a in actions)
    assert FreeBlocks(TID, D_BLOCKS) in actions  # the late allocation goes straight back
    assert any(isinstance(a, SendMessage) and isinstance(a.message, ReadFailed) for a in actions)


def test_reader_plans_from_every_overlapping_prefill_rank():
    c = reader(tp_rank=0, tp_size=1)
    c.offered(offer(p_tp=2), 0)
    (submit,) = [a for a in c.allocated(TID, LOCAL, D_BLOCKS, 0, 1) if isinstance(a, SubmitRead)]
    assert set(submit.plans) == {0, 1}
    assert {w.remote_agent for plan in submit.plans.values() for w in plan.writes} == {"p0", "p1"}
    total = sum(plan.bytes for plan in submit.plans.values())
    assert total == len(D_BLOCKS) * sum(r.block_bytes for r in REGIONS)


def test_reader_rejects_an_offer_with_the_wrong_block_count():
    c = reader()
    c.offered(offer(), 0)
    actions = c.allocated(TID, LOCAL, (7, 8), 0, 1)
    assert c.counters["offer_rejected"] == 1
    assert any(isinstance(a, FailTransfer) and "offer rejected" in a.reason for a in actions)
    assert FreeBlocks(TID, (7, 8)) in actions


@pytest.mark.parametrize("behind_s, refused", [(0.4, False), (3.0, True)])
def test_reader_refuses_an_offer_stamped_beyond_the_skew_allowance(behind_s, refused):
    """D's clock reading behind P's would start READs after P's lease freed the blocks."""
    c = ReaderCore(0, 1, ReaderTimeouts(max_read_s=2, clock_skew_allowance_s=0.5), strict=True)
    sent = 100.0
    stamped = msgspec.structs.replace(offer(expires_at=sent + 10), sent_at=sent)
    actions = c.offered(stamped, sent - behind_s)
    if not refused:
        assert c.state_of(TID) is RState.WAITING
        return
    assert c.state_of(TID) is RState.FAILED
    (failed,) = [a for a in actions if isinstance(a, FailTransfer)]
    assert "decode's clock" in failed.reason and "behind prefill's" in failed.reason
    assert any(isinstance(a, SendMessage) and isinstance(a.message, ReadFailed) for a in actions)
    late = c.allocated(TID, LOCAL, D_BLOCKS, 0, sent - behind_s + 0.1)
    assert FreeBlocks(TID, D_BLOCKS) in late and not any(isinstance(a, SubmitRead) for a in late)


def test_a_read_given_up_on_keeps_d_blocks_and_p_untold_until_it_ends():
    """Releasing a READ does not stop it (NIXL cannot cancel an RDMA op): its bytes may still land
    in D's blocks. After max_read_s D stops waiting for it, but its blocks go back to vLLM (and P
    is told to free its own) only when the READ ends; the load fails either way (D recomputes)."""
    c = reader()
    c.offered(offer(), 0)
    c.allocated(TID, LOCAL, D_BLOCKS, 0, 1)
    actions = c.tick(3)  # posted at 1, max_read_s 2
    assert c.state_of(TID) is RState.DRAINING
    assert not [a for a in actions if isinstance(a, (AbortRead, FreeBlocks, SendMessage, FailTransfer))]
    actions = c.read_done(TID, 3.5)  # it completed, but P's lease may have ended under it
    assert c.state_of(TID) is RState.FAILED
    kinds = [type(a) for a in actions if isinstance(a, (FailTransfer, FreeBlocks, SendMessage))]
    assert kinds == [FailTransfer, FreeBlocks, SendMessage]
    assert not [a for a in actions if isinstance(a, FinishLoad)]


def test_a_read_that_never_ends_is_released_after_a_second_max_read_s_before_freeing():
    c = reader()
    c.offered(offer(), 0)
    c.allocated(TID, LOCAL, D_BLOCKS, 0, 1)
    c.tick(3)
    assert not [a for a in c.tick(4.99) if isinstance(a, (AbortRead, FreeBlocks))]
    actions = c.tick(5)
    kinds = [type(a) for a in actions if isinstance(a, (AbortRead, FailTransfer, FreeBlocks))]
    assert kinds == [AbortRead, FailTransfer, FreeBlocks]
    assert any(isinstance(a, FailTransfer) and "max_read_s" in a.reason for a in actions)


def test_an_aborted_read_keeps_its_blocks_through_the_same_drain():
    c = reader()
    c.offered(offer(), 0)
    c.allocated(TID, LOCAL, D_BLOCKS, 0, 1)
    c.abort(TID, "client gone", 1.5)
    assert not [a for a in c.tick(4.99) if isinstance(a, FreeBlocks)]  # READ's deadline 3, then 2 more
    actions = c.tick(5)
    assert [type(a) for a in actions if isinstance(a, (AbortRead, FreeBlocks))] == [AbortRead, FreeBlocks]
    assert c.state_of(TID) is RState.CANCELLED


def test_a_read_from_a_prefill_that_is_gone_recovers_now_and_holds_its_blocks_until_the_read_ends():
    """P stopped mid-READ: the request goes on without the KV at once (before, it waited
    max_read_s, then max_read_s again); the blocks stay fenced until the READ ends or its drain
    deadline passes, whatever lands in them meanwhile never reaches decode."""
    c = reader()
    c.offered(offer(), 0)
    c.allocated(TID, LOCAL, D_BLOCKS, 0, 1)  # READ posted at 1: deadline 3, drained at 5
    actions = _suspect(c, 1.2)
    assert [type(a) for a in actions if isinstance(a, (Quarantine, FailTransfer, FreeBlocks))] == [Quarantine]
    assert c.state_of(TID) is RState.QUARANTINED
    assert not [a for a in c.tick(4.9) if isinstance(a, FreeBlocks)]
    actions = c.tick(5.0)
    assert AbortRead(TID) in actions and FreeBlocks(TID, D_BLOCKS) in actions


def test_an_offer_refused_for_clock_skew_leaves_no_deadline_to_fire_on_the_ended_transfer():
    c = ReaderCore(0, 1, ReaderTimeouts(max_read_s=2, clock_skew_allowance_s=0.5), strict=True)
    c.offered(msgspec.structs.replace(offer(expires_at=13.0), sent_at=10.0), 0)  # sent from 10 s in our future
    assert c.state_of(TID) is RState.FAILED
    c.tick(20)  # past the offer's expiry: strict, so an EXPIRED with no row would raise
    assert not [k for k in c.counters if k.startswith("undefined")]
