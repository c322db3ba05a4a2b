"""Every row of the producer's transition table, plus the scenarios its invariants are about."""

import msgspec
import pytest

from neuron_disagg.protocol import (
    AbortWrite, Cancel, CancelAck, FailTransfer, FreeBlocks, Heartbeat, ProducerCore,
    ProducerTimeouts, ProtocolError, PState, RankRegions, Registration, SendMessage, SubmitWrite,
    TransferId, WriteFailed,
)
from neuron_disagg.protocol.geometry import ModelShape, rank_regions
from neuron_disagg.protocol.producer import TABLE, PEffect, PEvent

SHAPE = ModelShape(2, 2, 8, 2, 4)
REGIONS = rank_regions(SHAPE, 16)
T = ProducerTimeouts(lease_s=10, max_write_s=5, watchdog_s=60, clock_skew_allowance_s=1, tombstone_s=100)
TID = TransferId("req", 0)
BLOCKS = (3, 4, 5)


def registration(tid=TID, expires_at=50.0, blocks=(7, 8, 9), first=0):
    return Registration(tid, "d", "d-req", "d-host:1", 1, (RankRegions(0, "d0", REGIONS),),
                        blocks, first, expires_at)


def cancel(tid=TID):
    return Cancel(tid, "d-host:1", 1, "client went away")


def core():
    return ProducerCore(REGIONS, timeouts=T, strict=True)


# How to bring a fresh core's transfer TID into each state, at t=0..3.
PATHS = {
    PState.NEW: [],
    PState.PREFILLING: [lambda c: c.chunk_ready(TID, (3,), 0)],
    PState.AWAITING_KV: [lambda c: c.registration_received(registration(), 0)],
    PState.STREAMING: [lambda c: c.registration_received(registration(), 0), lambda c: c.chunk_ready(TID, (3,), 1)],
    PState.FINISHING: [lambda c: c.registration_received(registration(), 0), lambda c: c.chunk_ready(TID, (3,), 1),
                       lambda c: c.kv_ready(TID, (3, 4, 5), 2)],
    PState.ABORTING: [lambda c: c.registration_received(registration(), 0), lambda c: c.chunk_ready(TID, (3,), 1),
                      lambda c: c.abort(TID, "client gone", 2)],
    PState.AWAITING_REGISTRATION: [lambda c: c.kv_ready(TID, BLOCKS, 0)],
    PState.WRITING: [lambda c: c.kv_ready(TID, BLOCKS, 0), lambda c: c.registration_received(registration(), 1)],
    PState.WRITING_CANCELLED: [lambda c: c.kv_ready(TID, BLOCKS, 0),
                               lambda c: c.registration_received(registration(), 1),
                               lambda c: c.cancel(cancel(), 2)],
    PState.DRAINING: [lambda c: c.kv_ready(TID, BLOCKS, 0), lambda c: c.registration_received(registration(), 1),
                      lambda c: c.tick(1 + T.max_write_s)],
    PState.DRAINING_CANCELLED: [lambda c: c.kv_ready(TID, BLOCKS, 0),
                                lambda c: c.registration_received(registration(), 1),
                                lambda c: c.tick(1 + T.max_write_s), lambda c: c.cancel(cancel(), 7)],
    PState.DONE: [lambda c: c.kv_ready(TID, BLOCKS, 0), lambda c: c.registration_received(registration(), 1),
                  lambda c: c.write_done(TID, 2)],
    PState.FAILED: [lambda c: c.registration_received(registration(), 0), lambda c: c.abort(TID, "gone", 1)],
    PState.CANCELLED: [lambda c: c.cancel(cancel(), 0)],
}

EVENTS = {
    PEvent.REGISTRATION: lambda c, now: c.registration_received(registration(), now),
    PEvent.KV_READY: lambda c, now: c.kv_ready(TID, (10, 11, 12), now),
    PEvent.WRITE_DONE: lambda c, now: c.write_done(TID, now),
    PEvent.WRITE_FAILED: lambda c, now: c.write_failed(TID, "transport error", now),
    PEvent.HEARTBEAT: lambda c, now: c.heartbeat(Heartbeat(TID, now), now),
    PEvent.CANCEL: lambda c, now: c.cancel(cancel(), now),
    PEvent.ABORT: lambda c, now: c.abort(TID, "engine shutdown", now),
    PEvent.EXPIRED: lambda c, now: c.tick(c.entries[TID].deadline),  # just the next deadline
    PEvent.SUPERSEDED: lambda c, now: c.kv_ready(TransferId("req", 1), (13,), now),
    PEvent.WITHDRAWN: lambda c, now: c.withdraw(TransferId("req", 0), "decode refused it", now),
    PEvent.CHUNK_READY: lambda c, now: c.chunk_ready(TID, (3, 4), now),
    PEvent.BACKLOG: lambda c, now: c.chunk_ready(TID, (3, 4), now),  # ours, after a chunk D can take
    # The write in flight is one of chunks (in states a last write also reaches, it is made one here).
    PEvent.CHUNK_DONE: lambda c, now: (setattr(c.entries[TID], "chunk_in_flight", True), c.write_done(TID, now))[1],
    PEvent.PREEMPTED: lambda c, now: c.preempted(TID, now),
}

EFFECT_ACTIONS = {
    PEffect.SUBMIT_WRITE: SubmitWrite, PEffect.SUBMIT_CHUNK: SubmitWrite, PEffect.ABORT_WRITE: AbortWrite,
    PEffect.FAIL: FailTransfer,
    PEffect.FREE_LATE_BLOCKS: FreeBlocks,
}


def _reach(state):
    c = core()
    for step in PATHS[state]:
        step(c)
    assert c.state_of(TID) is (None if state is PState.NEW else state)
    return c


@pytest.mark.parametrize("state,event", sorted(TABLE, key=lambda k: (k[0].value, k[1].value)),
                         ids=lambda v: v.name)
def test_every_table_row(state, event):
    if state is PState.NEW and event is PEvent.SUPERSEDED:
        c = core()
        c.kv_ready(TransferId("req", 1), (13,), 0)  # the newer attempt is known first
        actions = c.registration_received(registration(), 1)
        assert c.state_of(TID) is PState.CANCELLED
        assert [a.message for a in actions if isinstance(a, SendMessage)] == [CancelAck(TID, 0, 1)]
        return
    rule = TABLE[(state, event)]
    c = _reach(state)
    held_before = c.entries[TID].block_ids if TID in c.entries else None
    dropped_before = sum(v for k, v in c.counters.items() if k.startswith("dropped"))
    actions = EVENTS[event](c, 3.0)
    expected_state = rule.next_state or state
    if expected_state is PState.NEW:  # nothing known, or forgotten
        assert c.state_of(TID) is None
    elif PEffect.STREAM in rule.effects:  # may write at once, moving on by one of our own events
        assert c.state_of(TID) in (expected_state, PState.STREAMING, PState.WRITING, PState.FAILED)
    else:
        assert c.state_of(TID) is expected_state
    kinds = [type(a) for a in actions if a.__class__.__name__ != "Transitioned"]
    for effect in rule.effects:
        if effect in EFFECT_ACTIONS:
            assert EFFECT_ACTIONS[effect] in kinds, (effect, actions)
        elif effect is PEffect.FREE_BLOCKS:  # what is held: streaming states may hold none yet
            assert [a.block_ids for a in actions if isinstance(a, FreeBlocks)] == ([held_before] if held_before else [])
        elif effect in (PEffect.NOTIFY_FAILED, PEffect.NOTIFY_CANCEL_ACK):
            wanted = WriteFailed if effect is PEffect.NOTIFY_FAILED else CancelAck
            sent = [a for a in actions if isinstance(a, SendMessage)]
            assert any(isinstance(a.message, wanted) and a.peer == "d-host:1" for a in sent), actions
        elif effect is PEffect.DROP:
            assert sum(v for k, v in c.counters.items() if k.startswith("dropped")) > dropped_before
    if PEffect.FREE_BLOCKS not in rule.effects and PEffect.FREE_LATE_BLOCKS not in rule.effects:
        assert FreeBlocks not in kinds


def test_a_withdraw_frees_every_prompt_of_the_router_attempt_now_or_as_it_is_computed():
    """The router's Withdraw names its own transfer id; each engine request's transfer adds its
    prompt's digest. Held KV is freed at once, KV computed later as it comes in; other attempts and
    other requests are untouched, and a D that registered keeps its write."""
    c = core()
    a, b = TransferId("req", 0, "aaa"), TransferId("req", 0, "bbb")
    registered, other_attempt, other = TransferId("req", 0, "ccc"), TransferId("req", 1, "ddd"), TransferId("reqx", 0, "aaa")
    c.kv_ready(a, (1, 2), 0)
    c.registration_received(registration(registered), 0)
    c.kv_ready(other_attempt, (3,), 0)
    c.kv_ready(other, (4,), 0)
    actions = c.withdraw(TransferId("req", 0), "decode refused it", 1)
    assert [x for x in actions if isinstance(x, FreeBlocks)] == [FreeBlocks(a, (1, 2))]
    assert not [x for x in actions if isinstance(x, SendMessage)]  # nobody to answer
    assert c.state_of(a) is PState.CANCELLED and c.state_of(registered) is PState.AWAITING_KV
    assert c.state_of(other_attempt) is c.state_of(other) is PState.AWAITING_REGISTRATION
    late = c.kv_ready(b, (5, 6), 2)  # computed after the Withdraw came
    assert [x for x in late if isinstance(x, FreeBlocks)] == [FreeBlocks(b, (5, 6))]
    assert c.state_of(b) is PState.CANCELLED
    assert [x for x in c.kv_ready(registered, (10, 11, 12), 2) if isinstance(x, SubmitWrite)]  # D took it
    c.tick(2 + T.tombstone_s)  # the Withdraw is forgotten with the tombstones
    assert not [x for x in c.kv_ready(TransferId("req", 0, "eee"), (8,), 3 + T.tombstone_s) if isinstance(x, FreeBlocks)]


def test_undefined_pairs_raise_in_strict_mode_and_are_counted_otherwise():
    c = _reach(PState.AWAITING_KV)
    with pytest.raises(ProtocolError, match="no transition for WRITE_DONE in AWAITING_KV"):
        c.write_done(TID, 1)
    lenient = ProducerCore(REGIONS, timeouts=T)
    lenient.registration_received(registration(), 0)
    assert lenient.write_done(TID, 1) == []
    assert lenient.counters["undefined:AWAITING_KV:WRITE_DONE"] == 1


@pytest.mark.parametrize("registration_first", [True, False])
def test_rendezvous_matches_in_either_order_and_plans_the_write(registration_first):
    c = core()
    steps = [lambda: c.registration_received(registration(), 1), lambda: c.kv_ready(TID, BLOCKS, 2)]
    actions = [a for step in (steps if registration_first else steps[::-1]) for a in step()]
    (submit,) = [a for a in actions if isinstance(a, SubmitWrite)]
    assert submit.plan.bytes == 3 * len(REGIONS) * REGIONS[0].block_bytes
    assert submit.notification.transfer_id == TID and submit.d_side_channel == "d-host:1"
    assert c.entries[TID].deadline == 2 + T.max_write_s


def _sources(submit):
    return [(w.src_addr.tolist(), w.dst_addr.tolist(), w.length.tolist()) for w in submit.plan.writes]


def _fresh_plan_sources(blocks):
    c = core()
    c.registration_received(registration(), 0)
    (submit,) = [a for a in c.kv_ready(TID, blocks, 1) if isinstance(a, SubmitWrite)]
    return _sources(submit)


def test_a_write_planned_while_the_last_forward_runs_is_submitted_without_planning_again(monkeypatch):
    c = core()
    c.registration_received(registration(), 0)
    plan = c.kv_coming(TID, BLOCKS)
    assert c.state_of(TID) is PState.AWAITING_KV  # no transition
    assert plan is not None and c.planned_write(TID) is plan  # what the writer builds NIXL requests for
    monkeypatch.setattr("neuron_disagg.protocol.producer.plan_write",
                        lambda *a, **k: pytest.fail("kv_ready planned a write kv_coming had planned"))
    (submit,) = [a for a in c.kv_ready(TID, BLOCKS, 1) if isinstance(a, SubmitWrite)]
    monkeypatch.undo()
    assert _sources(submit) == _fresh_plan_sources(BLOCKS)
    assert submit.plan is plan  # the very plan: requests built for its writes are posted as they are
    assert c.entries[TID].planned is None and c.planned_write(TID) is None  # submitted: nothing kept
    assert c.counters["write_planned_ahead"] == 1


@pytest.mark.parametrize("case", ["other blocks", "before the registration", "rejected geometry"])
def test_a_plan_kv_ready_cannot_use_is_made_again_there(case):
    """The forward's blocks differ from those announced, D had not registered yet, or D's
    registration cannot be planned: kv_ready plans for what it has, as without kv_coming."""
    c = core()
    bad = registration(blocks=(7, 8, 999))
    if case == "before the registration":
        assert c.kv_coming(TID, BLOCKS) is None
        assert TID not in c.entries  # nothing created for a transfer D has not named
    c.registration_received(bad if case == "rejected geometry" else registration(), 0)
    if case != "before the registration":
        c.kv_coming(TID, (0, 1, 2) if case == "other blocks" else BLOCKS)
    actions = c.kv_ready(TID, BLOCKS, 1)
    if case == "rejected geometry":
        assert not any(isinstance(a, SubmitWrite) for a in actions)
        assert c.counters["registration_rejected"] == 1 and FreeBlocks(TID, BLOCKS) in actions
        return
    (submit,) = [a for a in actions if isinstance(a, SubmitWrite)]
    assert _sources(submit) == _fresh_plan_sources(BLOCKS)
    assert c.counters["write_planned_ahead"] == 0 and c.planned_write(TID) is None


def test_a_transfer_that_ends_before_its_kv_is_ready_keeps_no_plan():
    c = core()
    c.registration_received(registration(), 0)
    c.kv_coming(TID, BLOCKS)
    assert c.entries[TID].planned is not None
    c.cancel(cancel(), 1)
    assert c.state_of(TID) is PState.CANCELLED and c.entries[TID].planned is None  # kept until the tombstone goes
    assert c.planned_write(TID) is None  # the writer releases what it built for it


def test_registration_expired_on_arrival_is_never_written():
    c = core()
    c.kv_ready(TID, BLOCKS, 0)
    assert c.registration_received(registration(expires_at=5.0), 6.0) == []
    assert c.counters["dropped:registration:expired_on_arrival"] == 1
    assert c.state_of(TID) is PState.AWAITING_REGISTRATION


def test_registration_lapses_before_kv_ready_then_late_kv_is_freed():
    c = core()
    c.registration_received(registration(expires_at=5.0), 0)
    actions = c.kv_ready(TID, BLOCKS, 5.0)  # the expiry fires first: no write on a lapsed registration
    assert not any(isinstance(a, SubmitWrite) for a in actions)
    assert [a for a in actions if isinstance(a, FreeBlocks)] == [FreeBlocks(TID, BLOCKS)]
    assert c.state_of(TID) is PState.FAILED


def test_heartbeats_renew_the_lease_by_transfer_id_but_not_from_the_future():
    c = core()
    c.kv_ready(TID, BLOCKS, 0)
    c.heartbeat(Heartbeat(TID, 8.0), 8.0)
    assert c.entries[TID].deadline == 18.0
    c.heartbeat(Heartbeat(TID, 500.0), 9.0)  # a skewed or buggy sender cannot buy time ahead
    assert c.entries[TID].deadline == 19.0
    assert c.tick(18.9) == []
    actions = c.tick(19.0)
    assert FreeBlocks(TID, BLOCKS) in actions
    assert any(isinstance(a, FailTransfer) and "lease expired" in a.reason for a in actions)


def test_every_lapsed_lease_is_freed_in_the_tick_it_lapses_even_behind_live_ones():
    """vLLM's #58222: a reaper that stops at the first live entry leaves the lapsed ones behind it
    held. Here every other held transfer's lease is renewed, so live and lapsed entries alternate."""
    c = core()
    held = [TransferId(f"churn-{i}", 0) for i in range(24)]
    for i, tid in enumerate(held):
        c.kv_ready(tid, (i,), 0.0)
    for tid in held[::2]:
        c.heartbeat(Heartbeat(tid, 9.0), 9.0)
    freed = {a.transfer_id for a in c.tick(T.lease_s) if isinstance(a, FreeBlocks)}
    assert freed == set(held[1::2])
    assert all(c.state_of(tid) is PState.AWAITING_REGISTRATION for tid in held[::2])


def test_heartbeat_for_unknown_transfer_is_counted_not_created():
    c = core()
    c.heartbeat(Heartbeat(TransferId("nobody"), 1), 1)
    assert c.counters["dropped:heartbeat:unknown"] == 1 and not c.entries


def test_a_write_given_up_on_keeps_our_blocks_and_d_untold_until_it_ends():
    """Releasing a write does not stop it (NIXL cannot cancel an RDMA op): it may still read our
    blocks and land in D's. So after max_write_s P only stops waiting for it; its blocks stay held
    and D hears nothing (a WriteFailed lets D free its blocks at once) until the write ends."""
    c = _reach(PState.WRITING)
    actions = c.tick(1 + T.max_write_s)
    assert c.state_of(TID) is PState.DRAINING
    assert not [a for a in actions if isinstance(a, (AbortWrite, FreeBlocks, SendMessage, FailTransfer))]
    actions = c.write_failed(TID, "remote disconnected", 1 + T.max_write_s + 1)
    assert FreeBlocks(TID, BLOCKS) in actions
    (sent,) = [a for a in actions if isinstance(a, SendMessage)]
    assert isinstance(sent.message, WriteFailed) and "max_write_s" in sent.message.reason


def test_a_write_that_never_ends_is_released_after_a_second_max_write_s_before_freeing():
    c = _reach(PState.WRITING)
    c.tick(1 + T.max_write_s)
    assert not [a for a in c.tick(1 + 2 * T.max_write_s - 0.01) if isinstance(a, (AbortWrite, FreeBlocks))]
    actions = c.tick(1 + 2 * T.max_write_s)
    kinds = [type(a).__name__ for a in actions]
    assert kinds.index("AbortWrite") < kinds.index("FreeBlocks")
    (sent,) = [a for a in actions if isinstance(a, SendMessage)]
    assert isinstance(sent.message, WriteFailed) and "max_write_s" in sent.message.reason
    assert c.state_of(TID) is PState.FAILED


def test_a_write_that_completes_after_p_gave_up_is_delivered_not_failed():
    """Its WriteDone rode on it, and D takes a late delivery (consumer: TIMING_OUT, DELIVERED)."""
    c = _reach(PState.WRITING)
    c.tick(1 + T.max_write_s)
    actions = c.write_done(TID, 1 + T.max_write_s + 1)
    assert c.state_of(TID) is PState.DONE
    assert FreeBlocks(TID, BLOCKS) in actions
    assert not [a for a in actions if isinstance(a, (SendMessage, FailTransfer))]


def test_a_long_pause_past_both_deadlines_releases_the_write_at_once():
    c = _reach(PState.WRITING)
    actions = c.tick(1000)
    assert c.state_of(TID) is PState.FAILED
    assert [type(a) for a in actions if isinstance(a, (AbortWrite, FreeBlocks))] == [AbortWrite, FreeBlocks]


def test_cancel_during_write_keeps_blocks_until_the_write_ends():
    c = _reach(PState.WRITING_CANCELLED)
    assert c.entries[TID].block_ids == BLOCKS
    actions = c.write_failed(TID, "peer reset", 3)
    assert FreeBlocks(TID, BLOCKS) in actions
    assert any(isinstance(a, SendMessage) and isinstance(a.message, CancelAck) for a in actions)


def test_cancel_before_anything_fences_a_late_registration():
    c = core()
    c.cancel(cancel(), 0)
    actions = c.registration_received(registration(), 1)
    assert not any(isinstance(a, SubmitWrite) for a in actions)
    assert [type(a.message) for a in actions if isinstance(a, SendMessage)] == [CancelAck]
    assert c.kv_ready(TID, BLOCKS, 2) == [FreeBlocks(TID, BLOCKS)]


def test_newer_attempt_supersedes_a_held_transfer_and_stale_ones_never_write():
    c = core()
    c.kv_ready(TID, BLOCKS, 0)
    newer = TransferId("req", 1)
    actions = c.registration_received(registration(newer), 1)
    assert FreeBlocks(TID, BLOCKS) in actions and c.state_of(TID) is PState.CANCELLED
    actions = c.registration_received(registration(TID), 2)
    assert not any(isinstance(a, SubmitWrite) for a in actions)


def test_forged_geometry_is_rejected_before_any_write_and_counted():
    c = core()
    c.kv_ready(TID, BLOCKS, 0)
    actions = c.registration_received(registration(blocks=(7, 8, 999)), 1)
    assert not any(isinstance(a, SubmitWrite) for a in actions)
    assert c.counters["registration_rejected"] == 1
    assert FreeBlocks(TID, BLOCKS) in actions
    (sent,) = [a for a in actions if isinstance(a, SendMessage)]
    assert "registration rejected" in sent.message.reason


def test_tombstones_are_forgotten_after_tombstone_s():
    c = _reach(PState.DONE)
    c.tick(2 + T.tombstone_s - 0.1)
    assert TID in c.entries
    c.tick(2 + T.tombstone_s)
    assert TID not in c.entries


def test_clock_stepping_back_does_not_extend_anything():
    c = core()
    c.kv_ready(TID, BLOCKS, 100.0)
    c.tick(50.0)  # clock stepped back
    c.kv_ready(TransferId("other"), (1,), 50.0)
    assert c.entries[TransferId("other")].deadline == 100.0 + T.lease_s


def _d_rank_registration(d_rank, expires_at=50.0, blocks=(7, 8, 9)):
    """D at TP 2: each rank registers its own half of the heads."""
    regions = rank_regions(SHAPE, 16, d_rank, 2, base_addr=1 << 20)
    return Registration(TID, "d", "d-req", "d-host:1", 2, (RankRegions(d_rank, f"d{d_rank}", regions),),
                        blocks, 0, expires_at)


def test_with_fewer_p_ranks_than_d_ranks_the_write_waits_for_every_d_ranks_registration():
    c = core()  # P at TP 1 holds every head: it writes into both D ranks
    c.kv_ready(TID, BLOCKS, 0)
    assert not [a for a in c.registration_received(_d_rank_registration(1, expires_at=40.0), 1)
                if isinstance(a, SubmitWrite)]
    assert c.entries[TID].state is PState.AWAITING_REGISTRATION
    submits = [a for a in c.registration_received(_d_rank_registration(0), 2) if isinstance(a, SubmitWrite)]
    assert [w.d_rank for w in submits[0].plan.writes] == [0, 1]
    assert [w.remote_agent for w in submits[0].plan.writes] == ["d0", "d1"]
    assert c.entries[TID].registration.expires_at == 40.0  # the earliest of the two holds


def test_a_d_rank_registration_that_disagrees_with_the_others_is_dropped():
    c = core()
    c.registration_received(_d_rank_registration(0), 0)
    c.registration_received(_d_rank_registration(1, blocks=(1, 2, 3)), 1)
    assert c.counters["dropped:registration:inconsistent_ranks"] == 1
    assert c.entries[TID].registration is None
    c.registration_received(_d_rank_registration(1), 2)
    assert c.entries[TID].state is PState.AWAITING_KV


@pytest.mark.parametrize("behind_s, refused", [(0.9, False), (3.0, True)])
def test_a_registration_stamped_in_our_future_beyond_the_skew_allowance_is_refused_and_answered(behind_s, refused):
    """P's clock reading behind D's would keep honouring the registration after D's fence."""
    c = core()
    c.kv_ready(TID, BLOCKS, 0)
    sent = 10.0
    reg = msgspec.structs.replace(registration(expires_at=sent + 40), sent_at=sent)
    actions = c.registration_received(reg, sent - behind_s)
    if not refused:
        assert any(isinstance(a, SubmitWrite) for a in actions)
        return
    assert not any(isinstance(a, SubmitWrite) for a in actions)
    (answer,) = [a for a in actions if isinstance(a, SendMessage)]
    assert answer.peer == "d-host:1" and isinstance(answer.message, WriteFailed)
    assert "3.00 s behind decode's" in answer.message.reason and "chrony" in answer.message.reason
    assert any(isinstance(a, FailTransfer) for a in actions)
    assert c.counters["dropped:registration:clock_behind"] == 1
    assert c.state_of(TID) is PState.AWAITING_REGISTRATION  # our blocks go back when the lease ends
    assert FreeBlocks(TID, BLOCKS) in c.tick(T.lease_s)
    assert answer.message.reason.split(":")[0] == "clock skew"  # a bounded metrics label
