"""The decode (D) side of one tensor-parallel rank: registration, watchdog and block fencing.

D learns of a transfer when the router's decode leg arrives (``expect``), heartbeats P while it
waits to allocate, registers its destination blocks (``allocated``) and waits for a verdict from
every P rank that writes into this rank. D frees registered blocks only after every such rank has
confirmed — WriteDone, WriteFailed or CancelAck — or after a fence deadline that outlasts any write
P may still have in flight (I2): P starts no write after the registration's expiry, gives up on a
write after ``max_write_s`` and then waits as long again for it to end before it releases it (a
released write is not stopped), so ``expires_at + 2 * max_write_s + clock_skew_allowance_s`` is safe.

The request need not wait for that fence. D probes every P rank it waits on (``liveness.py``); when
one is gone — refused, silent for ``suspect_after_s``, or restarted — the transfer is QUARANTINED:
the request goes on at once without its blocks (``Quarantine``: computed here, or failed, as the
policy says), and the blocks stay fenced, where a late write from a P that was only paused may
still land, until P confirms or the fence lapses.

Every transition of this side is in ``TABLE``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from .actions import Action, FailTransfer, FinishLoad, FreeBlocks, Quarantine, SendMessage
from .liveness import PeerWatch
from .machine import LATE_ALLOCATION, Entry, Rule, StateMachine, Step, refuse_late_allocation
from .messages import Cancel, CancelAck, Heartbeat, Registration, TransferId, WriteDone, WriteFailed
from .plan import writer_ranks
from .timeouts import DEFAULTS


class DState(enum.Enum):
    NEW = "new"
    PENDING = "pending"            # decode leg known; no blocks allocated yet; heartbeating P
    REGISTERED = "registered"      # blocks registered with P; watchdog running
    CANCELLING = "cancelling"      # we gave up; blocks fenced until P confirms or the fence lapses
    TIMING_OUT = "timing_out"      # watchdog fired; same fence, but the outcome is a failure
    QUARANTINED = "quarantined"    # P is gone: the request went on without the KV; blocks fenced
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class DEvent(enum.Enum):
    EXPECT = "expect"
    ALLOCATED = "allocated"
    VERDICT = "verdict"            # one P rank confirmed; others still owe theirs
    DELIVERED = "delivered"        # every P rank confirmed with WriteDone
    UNDELIVERABLE = "undeliverable"  # every P rank confirmed; at least one did not write
    ABORT = "abort"
    EXPIRED = "expired"
    SUPERSEDED = "superseded"
    SUSPECTED = "suspected"        # a P rank we wait on is gone (liveness.py): only while we wait on P


class DEffect(enum.Enum):
    ARM_ADMISSION = "deadline := now + admission_timeout_s"
    SEND_REGISTRATION = "register blocks with P; deadline := expiry (now + watchdog_s)"
    SEND_CANCEL = "tell P: Cancel"
    ARM_FENCE = "deadline := expiry + 2 * max_write_s + clock_skew_allowance_s"
    FINISH_LOAD = "hand the loaded request to the engine"
    FREE_BLOCKS = "free the registered blocks"
    FREE_LATE_BLOCKS = "free blocks allocated after the transfer ended: never registered with P"
    FAIL = "fail the request upstream"
    QUARANTINE = "the request goes on without the KV now; the blocks stay fenced"
    COUNT_LATE_LANDING = "count P's write that landed in quarantined blocks (never decoded)"
    DROP = "count an event that changes nothing"


S, E, F = DState, DEvent, DEffect
TERMINAL = frozenset({S.DONE, S.FAILED, S.CANCELLED})

TABLE: dict[tuple[DState, DEvent], Rule[DState, DEffect]] = {
    (S.NEW, E.EXPECT): Rule(S.PENDING, (F.ARM_ADMISSION,)),
    (S.NEW, E.SUPERSEDED): Rule(S.CANCELLED, (), "superseded by a newer attempt"),
    # -- waiting for our own scheduler to allocate blocks --------------------------------------
    (S.PENDING, E.ALLOCATED): Rule(S.REGISTERED, (F.SEND_REGISTRATION,)),
    (S.PENDING, E.ABORT): Rule(S.CANCELLED, (F.SEND_CANCEL,)),
    (S.PENDING, E.SUPERSEDED): Rule(S.CANCELLED, (F.SEND_CANCEL,), "superseded by a newer attempt"),
    (S.PENDING, E.EXPIRED): Rule(
        S.FAILED, (F.SEND_CANCEL, F.FAIL), "decode did not admit the request within admission_timeout_s"),
    (S.PENDING, E.EXPECT): Rule(None, (F.DROP,)),
    (S.PENDING, E.SUSPECTED): Rule(S.FAILED, (F.SEND_CANCEL, F.FAIL)),  # its blocks, when allocated, fail at once
    # -- blocks registered: P's writes may land at any moment ----------------------------------
    (S.REGISTERED, E.VERDICT): Rule(None),
    (S.REGISTERED, E.DELIVERED): Rule(S.DONE, (F.FINISH_LOAD,)),
    (S.REGISTERED, E.UNDELIVERABLE): Rule(S.FAILED, (F.FAIL, F.FREE_BLOCKS)),
    (S.REGISTERED, E.ABORT): Rule(S.CANCELLING, (F.SEND_CANCEL, F.ARM_FENCE)),
    (S.REGISTERED, E.SUPERSEDED): Rule(
        S.CANCELLING, (F.SEND_CANCEL, F.ARM_FENCE), "superseded by a newer attempt"),
    (S.REGISTERED, E.EXPIRED): Rule(
        S.TIMING_OUT, (F.SEND_CANCEL, F.ARM_FENCE), "no KV from prefill within watchdog_s"),
    (S.REGISTERED, E.EXPECT): Rule(None, (F.DROP,)),
    (S.REGISTERED, E.SUSPECTED): Rule(S.QUARANTINED, (F.SEND_CANCEL, F.ARM_FENCE, F.QUARANTINE)),
    # -- fenced: blocks stay ours, untouched, until P confirms or the fence lapses ------------
    (S.CANCELLING, E.VERDICT): Rule(None),
    (S.CANCELLING, E.DELIVERED): Rule(S.CANCELLED, (F.FREE_BLOCKS,)),
    (S.CANCELLING, E.UNDELIVERABLE): Rule(S.CANCELLED, (F.FREE_BLOCKS,)),
    (S.CANCELLING, E.EXPIRED): Rule(S.CANCELLED, (F.FREE_BLOCKS,)),
    (S.CANCELLING, E.ABORT): Rule(None, (F.DROP,)),
    (S.CANCELLING, E.SUPERSEDED): Rule(None),
    (S.CANCELLING, E.EXPECT): Rule(None, (F.DROP,)),
    (S.TIMING_OUT, E.VERDICT): Rule(None),
    (S.TIMING_OUT, E.DELIVERED): Rule(S.DONE, (F.FINISH_LOAD,)),  # late, but every byte landed
    (S.TIMING_OUT, E.UNDELIVERABLE): Rule(S.FAILED, (F.FAIL, F.FREE_BLOCKS)),
    (S.TIMING_OUT, E.EXPIRED): Rule(S.FAILED, (F.FAIL, F.FREE_BLOCKS)),
    (S.TIMING_OUT, E.ABORT): Rule(S.CANCELLING),
    (S.TIMING_OUT, E.SUPERSEDED): Rule(S.CANCELLING),
    (S.TIMING_OUT, E.EXPECT): Rule(None, (F.DROP,)),
    (S.TIMING_OUT, E.SUSPECTED): Rule(S.QUARANTINED, (F.QUARANTINE,)),  # fence already armed
    # -- quarantined: the request went on; the blocks wait for P's word or the fence -----------
    (S.QUARANTINED, E.VERDICT): Rule(None),
    (S.QUARANTINED, E.DELIVERED): Rule(S.FAILED, (F.COUNT_LATE_LANDING, F.FREE_BLOCKS)),
    (S.QUARANTINED, E.UNDELIVERABLE): Rule(S.FAILED, (F.FREE_BLOCKS,)),
    (S.QUARANTINED, E.EXPIRED): Rule(S.FAILED, (F.FREE_BLOCKS,)),
    (S.QUARANTINED, E.ABORT): Rule(None, (F.DROP,)),
    (S.QUARANTINED, E.SUPERSEDED): Rule(None),
    (S.QUARANTINED, E.EXPECT): Rule(None, (F.DROP,)),
}
for _end in TERMINAL:
    TABLE.update({
        (_end, E.EXPECT): Rule(None, (F.DROP,)),
        (_end, E.ABORT): Rule(None, (F.DROP,)),  # e.g. the client leaves after its KV arrived
        (_end, E.SUPERSEDED): Rule(None),
        # A request of the same prompt and kv_transfer_params after this transfer ended (the
        # scheduler lets such a sibling use the KV this one brought; this is the last line): P
        # writes nothing more, so the load fails at once and D computes it, never waits for ever.
        (_end, E.ALLOCATED): Rule(None, (F.FAIL, F.FREE_LATE_BLOCKS), LATE_ALLOCATION),
    })


@dataclass
class ConsumerTransfer(Entry[DState]):
    p_side_channel: str = ""
    p_tp_size: int = 1
    registration: Registration | None = None
    owed_by: set[int] = field(default_factory=set)  # P ranks whose verdict we still wait for
    failure: str | None = None  # the first non-delivery verdict
    next_heartbeat_at: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ConsumerTimeouts:
    watchdog_s: float = DEFAULTS.watchdog_s
    admission_timeout_s: float = DEFAULTS.admission_timeout_s
    heartbeat_interval_s: float = DEFAULTS.heartbeat_interval_s
    max_write_s: float = DEFAULTS.max_write_s
    clock_skew_allowance_s: float = DEFAULTS.clock_skew_allowance_s
    tombstone_s: float = DEFAULTS.tombstone_s
    suspect_after_s: float = DEFAULTS.suspect_after_s


class ConsumerCore(StateMachine[DState, DEvent, DEffect, ConsumerTransfer]):
    """Transfers of one D tensor-parallel rank. Called by D's transfer thread, never the engine."""

    TABLE, NEW, TERMINAL = TABLE, DState.NEW, TERMINAL
    EXPIRED, SUPERSEDED, SUSPECTED = DEvent.EXPIRED, DEvent.SUPERSEDED, DEvent.SUSPECTED

    def __init__(self, side_channel: str, tp_rank: int = 0, tp_size: int = 1,
                 timeouts: ConsumerTimeouts = ConsumerTimeouts(), strict: bool = False,
                 total_heads: int | None = None):
        super().__init__(tombstone_s=timeouts.tombstone_s, strict=strict)
        self.side_channel = side_channel  # where P answers us (host:port)
        self.total_heads = total_heads  # the model's KV heads: ranks may hold replicas (plan.writer_ranks)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.timeouts = timeouts
        self.watch = PeerWatch(timeouts.suspect_after_s)

    def _new_entry(self, transfer_id: TransferId, now: float) -> ConsumerTransfer:
        return ConsumerTransfer(transfer_id, DState.NEW, now)

    # -- events from our own engine --------------------------------------------------------------
    def expect(self, transfer_id: TransferId, p_side_channel: str, p_tp_size: int, now: float) -> list[Action]:
        """The decode leg of a request arrived; P (at ``p_side_channel``) will produce its KV."""
        step = Step(self._clock(now))
        entry = self._entry(transfer_id, step, create=True)
        if entry.state is DState.NEW:
            entry.p_side_channel, entry.p_tp_size = p_side_channel, p_tp_size
            entry.next_heartbeat_at = step.now
        self._fire(entry, DEvent.EXPECT, step)
        return step.actions

    def allocated(self, registration: Registration, now: float) -> list[Action]:
        """Our scheduler allocated the destination blocks; register them with P. The core sets
        ``expires_at`` from its watchdog."""
        step = Step(self._clock(now), payload=registration)
        entry = self._entry(registration.transfer_id, step, create=False)
        if entry is None:  # never expected, or forgotten: the blocks must not wait for it
            self._drop("allocated:unknown")
            return refuse_late_allocation(registration.transfer_id, registration.block_ids)
        self._fire(entry, DEvent.ALLOCATED, step)
        return step.actions

    def abort(self, transfer_id: TransferId, reason: str, now: float) -> list[Action]:
        """The decode request was aborted locally (client gone, preempted, shutting down)."""
        step = Step(self._clock(now), reason=reason)
        entry = self._entry(transfer_id, step, create=False)
        if entry is None:
            self._drop("abort:unknown")
        else:
            self._fire(entry, DEvent.ABORT, step)
        return step.actions

    # -- verdicts from P ---------------------------------------------------------------------------
    def verdict(self, message: WriteDone | WriteFailed | CancelAck, now: float) -> list[Action]:
        """P rank ``message.p_rank`` finished with this transfer: wrote it, failed, or cancelled."""
        step = Step(self._clock(now), payload=message)
        entry = self._entry(message.transfer_id, step, create=False)
        name = type(message).__name__.lower()
        if entry is None:
            self._drop(f"{name}:unknown")
        elif (entry.state in TERMINAL or message.p_rank not in entry.owed_by
              or message.p_tp_size != entry.p_tp_size):
            self._drop(f"{name}:{entry.state.value}")  # duplicate, late, or never owed
        else:
            entry.owed_by.discard(message.p_rank)
            if not isinstance(message, WriteDone) and entry.failure is None:
                entry.failure = (message.reason if isinstance(message, WriteFailed)
                                 else "prefill acknowledged the cancellation")
            step.reason = entry.failure
            event = (DEvent.VERDICT if entry.owed_by else
                     DEvent.DELIVERED if entry.failure is None else DEvent.UNDELIVERABLE)
            self._fire(entry, event, step)
        return step.actions

    def undelivered(self, transfer_id: TransferId, p_rank: int, reason: str, now: float) -> list[Action]:
        """Our registration never reached P rank ``p_rank`` (the send failed; a rank acts only on a
        whole frame), so that rank will write nothing: as good as its WriteFailed, and its share of
        the fence is not needed."""
        entry = self.entries.get(transfer_id)
        if entry is None or entry.registration is None:
            self._drop("undelivered:unknown")
            return []
        return self.verdict(WriteFailed(transfer_id, p_rank, entry.p_tp_size,
                                        f"registration never reached prefill rank {p_rank}: {reason}"), now)

    def tick(self, now: float) -> list[Action]:
        """Time passed: fire lapsed deadlines; heartbeat and probe P for transfers still waiting on it."""
        actions = self._tick(now)
        self._watch_peers(Step(self._now, actions=actions))
        for entry in self.entries.values():
            if entry.state in (DState.PENDING, DState.REGISTERED) and self._now >= entry.next_heartbeat_at:
                entry.next_heartbeat_at = self._now + self.timeouts.heartbeat_interval_s
                actions.append(self._to_producer(entry, Heartbeat(entry.transfer_id, self._now)))
        return actions

    def _waits_on(self, entry: ConsumerTransfer) -> tuple[tuple[str, int], ...]:
        if entry.state is DState.PENDING:
            ranks = writer_ranks(self.tp_rank, self.tp_size, entry.p_tp_size, self.total_heads)
        elif entry.state in (DState.REGISTERED, DState.TIMING_OUT):
            ranks = tuple(sorted(entry.owed_by))
        else:
            return ()
        return tuple((entry.p_side_channel, rank) for rank in ranks)

    # -- effects ----------------------------------------------------------------------------------
    def _to_producer(self, entry: ConsumerTransfer, message: Heartbeat | Cancel) -> SendMessage:
        return SendMessage(entry.p_side_channel, tuple(range(entry.p_tp_size)), message)

    def _run_effect(self, entry: ConsumerTransfer, effect: DEffect, step: Step) -> None:
        t, tid = self.timeouts, entry.transfer_id
        if effect is F.ARM_ADMISSION:
            entry.deadline = step.now + t.admission_timeout_s
        elif effect is F.SEND_REGISTRATION:
            reg = msgspec.structs.replace(step.payload, expires_at=step.now + t.watchdog_s, sent_at=step.now)
            entry.registration, entry.deadline = reg, reg.expires_at
            entry.owed_by = set(writer_ranks(self.tp_rank, self.tp_size, entry.p_tp_size, self.total_heads))
            # Only to the P ranks holding our heads: a P rank plans with the D ranks it writes to,
            # and another D rank's registration there would be missing ours.
            step.actions.append(SendMessage(entry.p_side_channel, tuple(sorted(entry.owed_by)), reg))
        elif effect is F.SEND_CANCEL:
            step.actions.append(self._to_producer(entry, Cancel(
                tid, self.side_channel, self.tp_size, step.reason or "decode cancelled")))
        elif effect is F.ARM_FENCE:
            assert entry.registration is not None  # the fence follows SEND_REGISTRATION
            entry.deadline = entry.registration.expires_at + 2 * t.max_write_s + t.clock_skew_allowance_s
        elif effect is F.FINISH_LOAD:
            step.actions.append(FinishLoad(tid))
        elif effect is F.FREE_BLOCKS:
            assert entry.registration is not None  # the blocks are those SEND_REGISTRATION registered
            step.actions.append(FreeBlocks(tid, entry.registration.block_ids))
        elif effect is F.FREE_LATE_BLOCKS:
            self._drop("allocated:after_end")
            step.actions.append(FreeBlocks(tid, step.payload.block_ids))
        elif effect is F.FAIL:
            step.actions.append(FailTransfer(tid, step.reason or entry.reason or entry.failure or "failed"))
        elif effect is F.QUARANTINE:
            self.counters["quarantined"] += 1
            step.actions.append(Quarantine(tid, step.reason or entry.reason or "prefill gone"))
        elif effect is F.COUNT_LATE_LANDING:
            self.counters["landed_in_quarantine"] += 1
        elif effect is F.DROP:
            self._drop(f"{step.payload.__class__.__name__.lower()}:{entry.state.value}")
