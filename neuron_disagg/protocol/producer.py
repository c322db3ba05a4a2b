"""The prefill (P) side of one tensor-parallel rank: rendezvous, lease, streaming and write fencing.

A transfer starts from whichever arrives first — D's registration or our own "KV ready" — and a
write is submitted when both are there (the rendezvous). P never submits a write for a
registration that is cancelled, expired or superseded (invariant I1), answers every registration
with a verdict D can act on (WriteDone rides on the last write; WriteFailed or CancelAck
otherwise), and frees its own blocks exactly once (I4). Every non-terminal state has a deadline (I3).

Streaming: while the prefill runs, the engine reports each step's finished blocks (``chunk_ready``:
the prompt's leading blocks whose KV is final). Once D has registered they are written at once, one
write in flight per transfer: what finishes meanwhile goes as one merged write when it lands, and
the last write, which carries WriteDone, is posted only after every earlier one has completed. So
D's one notification still means every byte landed, and a rewrite (after vLLM preempted the
prefill and freed its blocks under a write) always lands after the write it corrects.

Every transition of this side is in ``TABLE``; a pair missing from it is a bug in the caller and is
counted (and raised under ``strict``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from .actions import AbortWrite, Action, FailTransfer, FreeBlocks, SendMessage, SubmitWrite
from .errors import PlanError
from .machine import Entry, Rule, StateMachine, Step, clock_behind_reason
from .messages import (
    Cancel,
    CancelAck,
    Heartbeat,
    Region,
    Registration,
    TransferId,
    WriteDone,
    WriteFailed,
)
from .plan import WritePlan, plan_write, target_ranks
from .timeouts import DEFAULTS


class PState(enum.Enum):
    NEW = "new"                                  # not yet known; only a lookup key
    PREFILLING = "prefilling"                    # no registration yet; part of the KV finished (noted)
    AWAITING_KV = "awaiting_kv"                  # registration in; prefill still running; nothing in flight
    STREAMING = "streaming"                      # registration in; a write of finished chunks in flight
    FINISHING = "finishing"                      # the same, the prefill done (blocks held): the rest follows it
    # The prefill request ended under a chunk write: vLLM may already reuse the blocks it reads, so D
    # is told (WriteFailed) only once the write has ended.
    ABORTING = "aborting"
    AWAITING_REGISTRATION = "awaiting_registration"  # our KV ready and held under a lease
    WRITING = "writing"
    WRITING_CANCELLED = "writing_cancelled"      # D cancelled while our write was in flight
    # We gave up on the write, but releasing it does not stop it (NIXL cannot cancel an RDMA op in
    # flight): it may still read our blocks and land in D's. So our blocks stay held and D is not
    # told to free its own until the write ends or a second max_write_s has passed.
    DRAINING = "draining"
    DRAINING_CANCELLED = "draining_cancelled"    # the same, after D cancelled
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class PEvent(enum.Enum):
    REGISTRATION = "registration"
    KV_READY = "kv_ready"
    WRITE_DONE = "write_done"
    WRITE_FAILED = "write_failed"
    HEARTBEAT = "heartbeat"
    CANCEL = "cancel"
    ABORT = "abort"
    EXPIRED = "expired"
    SUPERSEDED = "superseded"
    WITHDRAWN = "withdrawn"  # the router: no D takes this request (Withdraw)
    CHUNK_READY = "chunk_ready"  # the engine: more of the prompt's blocks are final
    CHUNK_DONE = "chunk_done"    # a write of chunks (no notification) completed
    BACKLOG = "backlog"          # ours: finished blocks not yet written, and the registration allows it
    PREEMPTED = "preempted"      # the engine freed the prefill's blocks: it is computed again


class PEffect(enum.Enum):
    ARM_REGISTRATION = "deadline := the registration's expiry"
    HOLD_BLOCKS = "remember the finished blocks"
    START_LEASE = "deadline := now + lease_s"
    NOTE_FINISHED = "remember the blocks finished so far (a rewrite from the start if they changed)"
    FORGET_FINISHED = "forget what was finished and written: it is computed again"
    FORGET = "forget the transfer: it held nothing and owed nobody a verdict"
    STREAM = "write the KV ready and not yet written: the rest with WriteDone, or the finished chunks"
    SUBMIT_CHUNK = "plan and submit the finished chunks not yet written; deadline := now + max_write_s"
    REARM_REGISTRATION = "deadline := the registration's"
    RENEW_LEASE = "deadline := heartbeat's send time + lease_s"
    SUBMIT_WRITE = "plan (unless kv_coming did) and submit the last write; deadline := now + max_write_s"
    DRAIN = "deadline := the write's deadline + max_write_s"
    ABORT_WRITE = "release the in-flight write"
    FREE_BLOCKS = "free the held blocks"
    FREE_LATE_BLOCKS = "free blocks handed over after the transfer ended"
    NOTIFY_FAILED = "tell D: WriteFailed"
    NOTIFY_CANCEL_ACK = "tell D: CancelAck"
    FAIL = "report the failure upstream"
    DROP = "count a message that changes nothing"


S, E, F = PState, PEvent, PEffect
TIMED_OUT = "write did not finish within max_write_s"
TERMINAL = frozenset({S.DONE, S.FAILED, S.CANCELLED})
#: where kv_coming's plan of the last write is kept: registered, the last write not yet submitted
PLANS_AHEAD = frozenset({S.AWAITING_KV, S.STREAMING, S.FINISHING})

TABLE: dict[tuple[PState, PEvent], Rule[PState, PEffect]] = {
    # -- first contact: either side of the rendezvous may come first -----------------------------
    (S.NEW, E.REGISTRATION): Rule(S.AWAITING_KV, (F.ARM_REGISTRATION,)),
    (S.NEW, E.KV_READY): Rule(S.AWAITING_REGISTRATION, (F.HOLD_BLOCKS, F.START_LEASE)),
    (S.NEW, E.CANCEL): Rule(S.CANCELLED, (F.NOTIFY_CANCEL_ACK,)),  # tombstone fences a late registration
    (S.NEW, E.ABORT): Rule(S.FAILED, (), "prefill request aborted"),
    (S.NEW, E.SUPERSEDED): Rule(S.CANCELLED, (), "superseded by a newer attempt"),
    (S.NEW, E.CHUNK_READY): Rule(S.PREFILLING, (F.NOTE_FINISHED, F.START_LEASE)),
    # -- prefill running, part of it finished, no registration yet: the backlog goes when one comes --
    (S.PREFILLING, E.CHUNK_READY): Rule(None, (F.NOTE_FINISHED, F.START_LEASE)),
    (S.PREFILLING, E.REGISTRATION): Rule(S.AWAITING_KV, (F.ARM_REGISTRATION, F.STREAM)),
    (S.PREFILLING, E.KV_READY): Rule(S.AWAITING_REGISTRATION, (F.HOLD_BLOCKS, F.START_LEASE)),
    (S.PREFILLING, E.HEARTBEAT): Rule(None, (F.RENEW_LEASE,)),
    (S.PREFILLING, E.PREEMPTED): Rule(None, (F.FORGET_FINISHED,)),
    (S.PREFILLING, E.CANCEL): Rule(S.CANCELLED, (F.NOTIFY_CANCEL_ACK,)),
    (S.PREFILLING, E.ABORT): Rule(S.FAILED, (), "prefill request aborted"),
    (S.PREFILLING, E.SUPERSEDED): Rule(S.CANCELLED, (), "superseded by a newer attempt"),
    (S.PREFILLING, E.WITHDRAWN): Rule(None),  # remembered: the KV is freed when it is ready
    # A prefill this slow, with no word from D: forgotten, as if never streamed (kv_ready starts afresh).
    (S.PREFILLING, E.EXPIRED): Rule(S.NEW, (F.FORGET,)),
    # -- registration in, prefill running -------------------------------------------------------
    (S.AWAITING_KV, E.KV_READY): Rule(S.WRITING, (F.HOLD_BLOCKS, F.SUBMIT_WRITE)),
    (S.AWAITING_KV, E.CHUNK_READY): Rule(None, (F.NOTE_FINISHED, F.STREAM)),
    (S.AWAITING_KV, E.BACKLOG): Rule(S.STREAMING, (F.SUBMIT_CHUNK,)),
    (S.AWAITING_KV, E.PREEMPTED): Rule(None, (F.FORGET_FINISHED,)),
    (S.AWAITING_KV, E.REGISTRATION): Rule(None, (F.DROP,)),
    (S.AWAITING_KV, E.HEARTBEAT): Rule(None),
    (S.AWAITING_KV, E.CANCEL): Rule(S.CANCELLED, (F.NOTIFY_CANCEL_ACK,)),
    (S.AWAITING_KV, E.ABORT): Rule(S.FAILED, (F.NOTIFY_FAILED, F.FAIL), "prefill request aborted"),
    (S.AWAITING_KV, E.EXPIRED): Rule(  # blocks held only when a chunk write ended past the expiry
        S.FAILED, (F.FREE_BLOCKS, F.NOTIFY_FAILED, F.FAIL), "registration expired before prefill finished"),
    (S.AWAITING_KV, E.SUPERSEDED): Rule(
        S.CANCELLED, (F.NOTIFY_CANCEL_ACK,), "superseded by a newer attempt"),
    # -- a write of finished chunks in flight; the prefill may have finished meanwhile (blocks held) --
    (S.STREAMING, E.CHUNK_DONE): Rule(S.AWAITING_KV, (F.REARM_REGISTRATION, F.STREAM)),
    (S.STREAMING, E.CHUNK_READY): Rule(None, (F.NOTE_FINISHED,)),  # goes when the write in flight lands
    (S.STREAMING, E.KV_READY): Rule(S.FINISHING, (F.HOLD_BLOCKS,)),  # the same
    (S.STREAMING, E.PREEMPTED): Rule(None, (F.FORGET_FINISHED,)),    # rewritten after the write in flight
    (S.STREAMING, E.WRITE_FAILED): Rule(S.FAILED, (F.FREE_BLOCKS, F.NOTIFY_FAILED, F.FAIL)),
    (S.STREAMING, E.EXPIRED): Rule(S.DRAINING, (F.DRAIN,), TIMED_OUT),
    (S.STREAMING, E.CANCEL): Rule(S.WRITING_CANCELLED),
    (S.STREAMING, E.SUPERSEDED): Rule(S.WRITING_CANCELLED),
    (S.STREAMING, E.ABORT): Rule(S.ABORTING, (), "prefill request aborted"),
    (S.STREAMING, E.HEARTBEAT): Rule(None),
    (S.STREAMING, E.REGISTRATION): Rule(None, (F.DROP,)),
    (S.STREAMING, E.WITHDRAWN): Rule(None, (F.DROP,)),
    (S.FINISHING, E.CHUNK_DONE): Rule(S.AWAITING_KV, (F.REARM_REGISTRATION, F.STREAM)),  # the rest, now
    (S.FINISHING, E.WRITE_FAILED): Rule(S.FAILED, (F.FREE_BLOCKS, F.NOTIFY_FAILED, F.FAIL)),
    (S.FINISHING, E.EXPIRED): Rule(S.DRAINING, (F.DRAIN,), TIMED_OUT),
    (S.FINISHING, E.CANCEL): Rule(S.WRITING_CANCELLED),
    (S.FINISHING, E.SUPERSEDED): Rule(S.WRITING_CANCELLED),
    (S.FINISHING, E.ABORT): Rule(None),  # as in WRITING: the write reads only blocks we hold
    (S.FINISHING, E.HEARTBEAT): Rule(None),
    (S.FINISHING, E.REGISTRATION): Rule(None, (F.DROP,)),
    (S.FINISHING, E.WITHDRAWN): Rule(None, (F.DROP,)),
    (S.FINISHING, E.KV_READY): Rule(None, (F.DROP,)),
    (S.ABORTING, E.CHUNK_DONE): Rule(S.FAILED, (F.FREE_BLOCKS, F.NOTIFY_FAILED, F.FAIL)),
    (S.ABORTING, E.WRITE_FAILED): Rule(S.FAILED, (F.FREE_BLOCKS, F.NOTIFY_FAILED, F.FAIL)),
    (S.ABORTING, E.EXPIRED): Rule(S.DRAINING, (F.DRAIN,), TIMED_OUT),
    (S.ABORTING, E.CANCEL): Rule(None),  # D's cancelled transfer takes the WriteFailed that follows
    # -- KV ready, held under a lease until D registers ----------------------------------------
    (S.AWAITING_REGISTRATION, E.REGISTRATION): Rule(S.WRITING, (F.SUBMIT_WRITE,)),
    (S.AWAITING_REGISTRATION, E.HEARTBEAT): Rule(None, (F.RENEW_LEASE,)),
    (S.AWAITING_REGISTRATION, E.CANCEL): Rule(S.CANCELLED, (F.FREE_BLOCKS, F.NOTIFY_CANCEL_ACK)),
    (S.AWAITING_REGISTRATION, E.ABORT): Rule(S.FAILED, (F.FREE_BLOCKS, F.FAIL), "prefill request aborted"),
    (S.AWAITING_REGISTRATION, E.EXPIRED): Rule(
        S.FAILED, (F.FREE_BLOCKS, F.FAIL), "lease expired: no registration or heartbeat from decode"),
    (S.AWAITING_REGISTRATION, E.SUPERSEDED): Rule(
        S.CANCELLED, (F.FREE_BLOCKS,), "superseded by a newer attempt"),
    (S.AWAITING_REGISTRATION, E.WITHDRAWN): Rule(
        S.CANCELLED, (F.FREE_BLOCKS,), "withdrawn by the router: no decode instance took the request"),
    (S.AWAITING_KV, E.WITHDRAWN): Rule(None, (F.DROP,)),  # a D registered: it took the request after all
    (S.WRITING, E.WITHDRAWN): Rule(None, (F.DROP,)),
    (S.WRITING_CANCELLED, E.WITHDRAWN): Rule(None, (F.DROP,)),
    # -- our write is in flight: our blocks stay held until it ends ----------------------------
    (S.WRITING, E.WRITE_DONE): Rule(S.DONE, (F.FREE_BLOCKS,)),  # WriteDone rode on the write
    (S.WRITING, E.WRITE_FAILED): Rule(S.FAILED, (F.FREE_BLOCKS, F.NOTIFY_FAILED, F.FAIL)),
    (S.WRITING, E.EXPIRED): Rule(S.DRAINING, (F.DRAIN,), TIMED_OUT),
    (S.WRITING, E.CANCEL): Rule(S.WRITING_CANCELLED),
    (S.WRITING, E.SUPERSEDED): Rule(S.WRITING_CANCELLED),
    (S.WRITING, E.ABORT): Rule(None),  # the write reads only blocks we hold; let it finish
    (S.WRITING, E.HEARTBEAT): Rule(None),
    (S.WRITING, E.REGISTRATION): Rule(None, (F.DROP,)),
    (S.WRITING_CANCELLED, E.WRITE_DONE): Rule(S.CANCELLED, (F.FREE_BLOCKS,)),
    (S.WRITING_CANCELLED, E.CHUNK_DONE): Rule(S.CANCELLED, (F.FREE_BLOCKS, F.NOTIFY_CANCEL_ACK)),
    (S.WRITING_CANCELLED, E.WRITE_FAILED): Rule(S.CANCELLED, (F.FREE_BLOCKS, F.NOTIFY_CANCEL_ACK)),
    (S.WRITING_CANCELLED, E.EXPIRED): Rule(S.DRAINING_CANCELLED, (F.DRAIN,), TIMED_OUT),
    (S.WRITING_CANCELLED, E.CANCEL): Rule(None, (F.DROP,)),
    (S.WRITING_CANCELLED, E.SUPERSEDED): Rule(None),
    (S.WRITING_CANCELLED, E.ABORT): Rule(None),
    (S.WRITING_CANCELLED, E.HEARTBEAT): Rule(None, (F.DROP,)),
    (S.WRITING_CANCELLED, E.REGISTRATION): Rule(None, (F.DROP,)),
    # -- gave up on the write: until it ends, it may still read our blocks and land in D's -------
    (S.DRAINING, E.WRITE_DONE): Rule(S.DONE, (F.FREE_BLOCKS,)),  # late: D accepts it (TIMING_OUT)
    (S.DRAINING, E.WRITE_FAILED): Rule(S.FAILED, (F.FREE_BLOCKS, F.NOTIFY_FAILED, F.FAIL), TIMED_OUT),
    (S.DRAINING, E.CHUNK_DONE): Rule(S.FAILED, (F.FREE_BLOCKS, F.NOTIFY_FAILED, F.FAIL), TIMED_OUT),
    (S.DRAINING, E.EXPIRED): Rule(S.FAILED, (F.ABORT_WRITE, F.FREE_BLOCKS, F.NOTIFY_FAILED, F.FAIL), TIMED_OUT),
    (S.DRAINING, E.CANCEL): Rule(S.DRAINING_CANCELLED),
    (S.DRAINING, E.SUPERSEDED): Rule(S.DRAINING_CANCELLED),
    (S.DRAINING_CANCELLED, E.WRITE_DONE): Rule(S.CANCELLED, (F.FREE_BLOCKS,)),
    (S.DRAINING_CANCELLED, E.WRITE_FAILED): Rule(S.CANCELLED, (F.FREE_BLOCKS, F.NOTIFY_CANCEL_ACK)),
    (S.DRAINING_CANCELLED, E.CHUNK_DONE): Rule(S.CANCELLED, (F.FREE_BLOCKS, F.NOTIFY_CANCEL_ACK)),
    (S.DRAINING_CANCELLED, E.EXPIRED): Rule(S.CANCELLED, (F.ABORT_WRITE, F.FREE_BLOCKS, F.NOTIFY_CANCEL_ACK)),
    (S.DRAINING_CANCELLED, E.CANCEL): Rule(None, (F.DROP,)),
    (S.DRAINING_CANCELLED, E.SUPERSEDED): Rule(None),
}
for _draining in (S.DRAINING, S.DRAINING_CANCELLED, S.ABORTING):
    TABLE.update({(_draining, E.ABORT): Rule(None), (_draining, E.WITHDRAWN): Rule(None, (F.DROP,)),
                  (_draining, E.HEARTBEAT): Rule(None, (F.DROP,)), (_draining, E.REGISTRATION): Rule(None, (F.DROP,))})
TABLE[(S.ABORTING, E.SUPERSEDED)] = Rule(None)
for _ending in (S.WRITING_CANCELLED, S.DRAINING, S.DRAINING_CANCELLED, S.ABORTING):
    # The prefill went on under a chunk write the transfer will not use: its blocks go back now (D
    # decodes nothing of this transfer, so the write may read them reused).
    TABLE.update({(_ending, E.KV_READY): Rule(None, (F.FREE_LATE_BLOCKS,)),
                  (_ending, E.CHUNK_READY): Rule(None), (_ending, E.PREEMPTED): Rule(None)})
for _final in (S.AWAITING_REGISTRATION, S.WRITING, S.FINISHING):
    # Every block is held from KV_READY on: no chunk comes after it, and nothing is preempted.
    TABLE.update({(_final, E.CHUNK_READY): Rule(None, (F.DROP,)), (_final, E.PREEMPTED): Rule(None, (F.DROP,))})
for _end, _answer in ((S.DONE, F.DROP), (S.FAILED, F.NOTIFY_FAILED), (S.CANCELLED, F.NOTIFY_CANCEL_ACK)):
    TABLE.update({
        # A registration or cancel after the end gets the same verdict again, so D never waits.
        (_end, E.REGISTRATION): Rule(None, (_answer,)),
        (_end, E.CANCEL): Rule(None, (_answer,)),
        (_end, E.KV_READY): Rule(None, (F.FREE_LATE_BLOCKS,)),  # e.g. D cancelled before prefill ended
        (_end, E.HEARTBEAT): Rule(None, (F.DROP,)),
        (_end, E.ABORT): Rule(None, (F.DROP,)),
        (_end, E.SUPERSEDED): Rule(None),
        (_end, E.WITHDRAWN): Rule(None),
        (_end, E.CHUNK_READY): Rule(None),
        (_end, E.PREEMPTED): Rule(None),
        # A completion racing our own abort of the write (ABORT_WRITE on expiry).
        (_end, E.WRITE_DONE): Rule(None, (F.DROP,)),
        (_end, E.CHUNK_DONE): Rule(None, (F.DROP,)),
        (_end, E.WRITE_FAILED): Rule(None, (F.DROP,)),
    })


@dataclass
class ProducerTransfer(Entry[PState]):
    registration: Registration | None = None
    block_ids: tuple[int, ...] | None = None
    reply_to: str | None = None  # D's side channel, from its registration or cancel
    d_tp_size: int = 1
    partial: list[Registration] = field(default_factory=list)  # D ranks registered so far (P TP < D TP)
    planned: tuple[Registration, tuple[int, ...], int, WritePlan] | None = None  # kv_coming's: for which registration, blocks and start
    registration_deadline: float | None = None  # ARM_REGISTRATION's deadline, again after each chunk write
    finished: tuple[int, ...] = ()  # the prompt's leading blocks whose KV is final (chunk_ready)
    written: int = 0  # of the prompt's blocks, how many lead blocks went to D (written or in flight)
    chunk_in_flight: bool = False  # the write in flight is one of chunks (no notification), not the last


@dataclass(frozen=True, kw_only=True)
class ProducerTimeouts:
    lease_s: float = DEFAULTS.lease_s
    max_write_s: float = DEFAULTS.max_write_s
    watchdog_s: float = DEFAULTS.watchdog_s  # caps how long a registration can keep us waiting
    clock_skew_allowance_s: float = DEFAULTS.clock_skew_allowance_s
    tombstone_s: float = DEFAULTS.tombstone_s


class ProducerCore(StateMachine[PState, PEvent, PEffect, ProducerTransfer]):
    """Transfers of one P tensor-parallel rank. Every method is called by that rank's writer
    thread (or a test), never by the engine loop, and returns the actions to perform in order."""

    TABLE, NEW, TERMINAL = TABLE, PState.NEW, TERMINAL
    EXPIRED, SUPERSEDED, WITHDRAWN = PEvent.EXPIRED, PEvent.SUPERSEDED, PEvent.WITHDRAWN

    def __init__(self, regions: tuple[Region, ...], tp_rank: int = 0, tp_size: int = 1,
                 timeouts: ProducerTimeouts = ProducerTimeouts(), strict: bool = False,
                 merge_descriptors: bool = True, total_heads: int | None = None,
                 join: tuple[int, ...] | None = None):
        super().__init__(tombstone_s=timeouts.tombstone_s, strict=strict)
        self.regions = regions
        self.join = join  # each region's join class (plan.plan_rank_write): its group of layers, streaming by them
        self.total_heads = total_heads  # the model's KV heads: ranks may hold replicas (plan.writer_ranks)
        self.merge_descriptors = merge_descriptors  # False only to measure what merging saves
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.timeouts = timeouts

    def _new_entry(self, transfer_id: TransferId, now: float) -> ProducerTransfer:
        return ProducerTransfer(transfer_id, PState.NEW, now)

    # -- events -----------------------------------------------------------------------------------
    def registration_received(self, registration: Registration, now: float) -> list[Action]:
        """D's registration arrived (already decoded and signature-checked)."""
        step = Step(self._clock(now), payload=registration)
        if step.now >= registration.expires_at:  # delivered too late to be honoured (I1)
            self._drop("registration:expired_on_arrival")
            return []
        if registration.sent_at - step.now > self.timeouts.clock_skew_allowance_s:
            # Our clock would honour it past D's fence: refuse, and tell D so it fails (recomputes) now.
            self._drop("registration:clock_behind")
            reason = clock_behind_reason("prefill", "decode", registration.sent_at, step.now,
                                         self.timeouts.clock_skew_allowance_s)
            ranks = target_ranks(self.tp_rank, self.tp_size, registration.d_tp_size, self.total_heads)
            return [SendMessage(registration.d_side_channel, ranks,
                                WriteFailed(registration.transfer_id, self.tp_rank, self.tp_size, reason)),
                    FailTransfer(registration.transfer_id, reason)]
        entry = self._entry(registration.transfer_id, step, create=True)
        if entry.registration is None and entry.state not in TERMINAL:
            whole = self._gather(entry, registration)
            if whole is None:
                return step.actions
            step.payload = registration = whole
        if entry.registration is None or entry.state in TERMINAL:
            entry.reply_to, entry.d_tp_size = registration.d_side_channel, registration.d_tp_size
        self._fire(entry, PEvent.REGISTRATION, step)
        return step.actions

    def _gather(self, entry: ProducerTransfer, registration: Registration) -> Registration | None:
        """With more D ranks than P ranks, each D rank registers its own regions with the P ranks
        holding its heads: wait until every D rank this rank writes to has registered, then go on
        as if one registration named them all (the earliest expiry holds)."""
        needed = set(target_ranks(self.tp_rank, self.tp_size, registration.d_tp_size, self.total_heads))
        if len(needed) == 1:
            return registration
        first = entry.partial[0] if entry.partial else registration
        if (registration.block_ids, registration.first_block_index, registration.d_tp_size,
                registration.d_side_channel) != (first.block_ids, first.first_block_index, first.d_tp_size,
                                                 first.d_side_channel):
            self._drop("registration:inconsistent_ranks")
            return None
        entry.partial.append(registration)
        ranks = {r.tp_rank: r for reg in entry.partial for r in reg.ranks}
        if not needed <= set(ranks):
            if entry.state is PState.PREFILLING:  # word from D: what it gathered is kept while it may complete
                entry.deadline = max(entry.deadline or 0.0, min(registration.expires_at, self._now + self.timeouts.watchdog_s))
            return None
        return msgspec.structs.replace(first, ranks=tuple(ranks[r] for r in sorted(ranks)),
                                       expires_at=min(reg.expires_at for reg in entry.partial))

    def kv_ready(self, transfer_id: TransferId, block_ids: tuple[int, ...], now: float) -> list[Action]:
        """Prefill finished; ``block_ids`` (exactly the prompt's blocks) are ours to free."""
        step = Step(self._clock(now), payload=tuple(block_ids))
        entry = self._entry(transfer_id, step, create=True)
        self._fire(entry, PEvent.KV_READY, step)
        self._if_withdrawn(entry, step)
        return step.actions

    def chunk_ready(self, transfer_id: TransferId, block_ids: tuple[int, ...], now: float) -> list[Action]:
        """The prefill runs on: ``block_ids``, the prompt's leading blocks, hold final KV (the step
        that computed them ended, past its fence). They stay the engine's: nothing is freed for them."""
        step = Step(self._clock(now), payload=tuple(block_ids))
        self._fire(self._entry(transfer_id, step, create=True), PEvent.CHUNK_READY, step)
        return step.actions

    def preempted(self, transfer_id: TransferId, now: float) -> list[Action]:
        """The engine preempted the prefill and freed its blocks, possibly under a chunk write: what
        was finished is computed again, and everything written is written again after it."""
        return self._local(transfer_id, PEvent.PREEMPTED, now, None, quiet=True)

    def kv_coming(self, transfer_id: TransferId, block_ids: tuple[int, ...]) -> WritePlan | None:
        """The forward that completes this prefill is about to run and its KV will be in
        ``block_ids``: if D has registered, plan the write now, so that ``kv_ready`` only submits
        it. Returns that plan, for the caller to build its transfers ahead too. Changes no state; a
        plan kv_ready cannot use (other blocks, another registration) is made again there."""
        entry = self.entries.get(transfer_id)
        if entry is None or entry.state not in PLANS_AHEAD or entry.registration is None:
            return None
        try:
            plan = self._plan(entry.registration, block_ids, entry.written)
        except PlanError:
            return None  # kv_ready plans again and fails the transfer with the reason
        entry.planned = (entry.registration, tuple(block_ids), entry.written, plan)
        return plan

    def planned_write(self, transfer_id: TransferId) -> WritePlan | None:
        """The plan ``kv_coming`` made that ``kv_ready`` may still submit, if any."""
        entry = self.entries.get(transfer_id)
        return entry.planned[3] if entry is not None and entry.planned is not None else None

    def write_done(self, transfer_id: TransferId, now: float) -> list[Action]:
        """The write in flight completed: the last (its notification went with it) or one of chunks."""
        entry = self.entries.get(transfer_id)
        chunk = entry is not None and entry.chunk_in_flight
        return self._local(transfer_id, PEvent.CHUNK_DONE if chunk else PEvent.WRITE_DONE, now, None)

    def write_failed(self, transfer_id: TransferId, reason: str, now: float) -> list[Action]:
        """The write failed and none of it is in flight any more."""
        return self._local(transfer_id, PEvent.WRITE_FAILED, now, reason)

    def abort(self, transfer_id: TransferId, reason: str, now: float) -> list[Action]:
        """The prefill request was aborted locally (client gone, engine shutting down)."""
        step = Step(self._clock(now), reason=reason)
        self._fire(self._entry(transfer_id, step, create=True), PEvent.ABORT, step)
        return step.actions

    def heartbeat(self, heartbeat: Heartbeat, now: float) -> list[Action]:
        step = Step(self._clock(now), payload=heartbeat)
        entry = self._entry(heartbeat.transfer_id, step, create=False)
        if entry is None:
            self._drop("heartbeat:unknown")
        else:
            self._fire(entry, PEvent.HEARTBEAT, step)
        return step.actions

    def cancel(self, cancel: Cancel, now: float) -> list[Action]:
        step = Step(self._clock(now), reason=cancel.reason, payload=cancel)
        entry = self._entry(cancel.transfer_id, step, create=True)
        entry.reply_to = entry.reply_to or cancel.d_side_channel
        if entry.registration is None:
            entry.d_tp_size = cancel.d_tp_size
        self._fire(entry, PEvent.CANCEL, step)
        return step.actions

    def tick(self, now: float) -> list[Action]:
        """Time passed: fire lapsed leases, registration expiries and write deadlines."""
        return self._tick(now)

    def _local(self, transfer_id: TransferId, event: PEvent, now: float, reason: str | None,
               quiet: bool = False) -> list[Action]:
        step = Step(self._clock(now), reason=reason)
        entry = self.entries.get(transfer_id)
        if entry is None:
            if not quiet:
                self._drop(f"{event.value}:unknown")
            return []
        self._fire(entry, event, step)
        return step.actions

    def _fire(self, entry: ProducerTransfer, event: PEvent, step: Step) -> None:
        super()._fire(entry, event, step)
        if entry.state not in PLANS_AHEAD:
            entry.planned = None  # only the last write from there uses it; ended entries keep no plan

    # -- effects ----------------------------------------------------------------------------------
    def _run_effect(self, entry: ProducerTransfer, effect: PEffect, step: Step) -> None:
        t, tid = self.timeouts, entry.transfer_id
        if effect is F.ARM_REGISTRATION:
            entry.registration = step.payload
            entry.deadline = min(step.payload.expires_at, step.now + t.watchdog_s + t.clock_skew_allowance_s)
            entry.registration_deadline = entry.deadline
        elif effect is F.REARM_REGISTRATION:
            entry.deadline = entry.registration_deadline
        elif effect is F.NOTE_FINISHED:
            self._rewrite_unless_extended(entry, step.payload)
            entry.finished = step.payload
        elif effect is F.FORGET_FINISHED:
            if entry.written:
                self.counters["stream_rewritten"] += 1
            entry.finished, entry.written = (), 0
        elif effect is F.FORGET:
            entry.finished, entry.written, entry.deadline = (), 0, None
        elif effect is F.STREAM:
            self._stream(entry, step)
        elif effect is F.SUBMIT_CHUNK:
            self._submit(entry, step, chunk=True)
        elif effect is F.HOLD_BLOCKS:
            entry.block_ids = step.payload
        elif effect is F.START_LEASE:
            entry.deadline = step.now + t.lease_s
        elif effect is F.RENEW_LEASE:
            sent_at = min(step.payload.sent_at, step.now)  # a heartbeat cannot buy time from the future
            entry.deadline = max(entry.deadline or 0.0, sent_at + t.lease_s)
        elif effect is F.SUBMIT_WRITE:
            if entry.registration is None:
                entry.registration = step.payload
            self._submit(entry, step)
        elif effect is F.DRAIN:
            assert entry.deadline is not None  # set by SUBMIT_WRITE: a write is in flight
            entry.deadline += t.max_write_s
        elif effect is F.ABORT_WRITE:
            step.actions.append(AbortWrite(tid))
        elif effect is F.FREE_BLOCKS:
            if entry.block_ids is not None:
                step.actions.append(FreeBlocks(tid, entry.block_ids))
                entry.block_ids = None
        elif effect is F.FREE_LATE_BLOCKS:
            self._drop("kv_ready:after_end")
            step.actions.append(FreeBlocks(tid, step.payload))
        elif effect is F.NOTIFY_FAILED:
            self._notify(entry, step, WriteFailed(tid, self.tp_rank, self.tp_size,
                                                  step.reason or entry.reason or "failed"))
        elif effect is F.NOTIFY_CANCEL_ACK:
            self._notify(entry, step, CancelAck(tid, self.tp_rank, self.tp_size))
        elif effect is F.FAIL:
            step.actions.append(FailTransfer(tid, step.reason or entry.reason or "failed"))
        elif effect is F.DROP:
            self._drop(f"{type(step.payload).__name__.lower()}:{entry.state.value}")

    def _notify(self, entry: ProducerTransfer, step: Step, message: WriteFailed | CancelAck) -> None:
        peer = entry.reply_to
        if isinstance(step.payload, (Registration, Cancel)):  # answer whoever asked
            peer = step.payload.d_side_channel
        if peer is None:
            self._drop("notify:no_peer")
            return
        d_tp = step.payload.d_tp_size if isinstance(step.payload, (Registration, Cancel)) else entry.d_tp_size
        step.actions.append(SendMessage(peer, target_ranks(self.tp_rank, self.tp_size, d_tp, self.total_heads),
                                        message))

    def _stream(self, entry: ProducerTransfer, step: Step) -> None:
        """Nothing in flight: write what is ready — the rest, once the prefill finished; else the
        finished chunks D registered and has not been sent — unless the registration lapsed."""
        if entry.deadline is not None and step.now >= entry.deadline:
            self._expire_if_due(entry, step)
        elif entry.block_ids is not None:
            self._fire(entry, PEvent.KV_READY, Step(step.now, payload=entry.block_ids, actions=step.actions))
        elif entry.registration is not None and len(entry.finished) > max(
                entry.written, entry.registration.first_block_index):
            self._fire(entry, PEvent.BACKLOG, Step(step.now, actions=step.actions))

    def _rewrite_unless_extended(self, entry: ProducerTransfer, blocks: tuple[int, ...]) -> None:
        """``blocks`` do not begin with those already written (computed again elsewhere): write all again."""
        if blocks[:entry.written] != entry.finished[:entry.written]:
            self.counters["stream_rewritten"] += 1
            entry.written = 0

    def _submit(self, entry: ProducerTransfer, step: Step, chunk: bool = False) -> None:
        reg, planned = entry.registration, entry.planned
        blocks = entry.finished if chunk else entry.block_ids
        assert reg is not None and blocks is not None  # SUBMIT_WRITE follows ARM_REGISTRATION and HOLD_BLOCKS
        if not chunk:
            self._rewrite_unless_extended(entry, blocks)
        try:
            if not chunk and planned is not None and planned[0] is reg and planned[1:3] == (blocks, entry.written):
                plan = planned[3]
                self.counters["write_planned_ahead"] += 1
            else:
                plan = self._plan(reg, blocks, entry.written, final=not chunk)
        except PlanError as exc:
            self.counters["registration_rejected"] += 1
            step.payload = None
            self._fire(entry, PEvent.WRITE_FAILED, Step(step.now, f"registration rejected: {exc}",
                                                         actions=step.actions))
            return
        entry.deadline = step.now + self.timeouts.max_write_s
        entry.written, entry.chunk_in_flight = len(blocks), chunk
        step.actions.append(SubmitWrite(
            entry.transfer_id, plan, reg.d_side_channel,
            None if chunk else WriteDone(entry.transfer_id, self.tp_rank, self.tp_size)))

    def _plan(self, registration: Registration, block_ids: tuple[int, ...], start: int = 0,
              final: bool = True) -> WritePlan:
        return plan_write(self.regions, self.tp_rank, self.tp_size, registration, block_ids,
                          self.merge_descriptors, self.total_heads, start=start, final=final, join=self.join)
