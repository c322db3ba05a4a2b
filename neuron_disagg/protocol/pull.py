"""Pull mode: D reads P's KV after P finished, for deployments that pick D late.

P (the lender, per rank) offers its finished blocks (``PullOffer``) and holds them under a lease;
D (the reader, per rank) allocates, then READs from every P rank whose heads it needs, off its
engine loop. The fencing mirrors push: D starts no READ after the offer's ``expires_at`` and
abandons a READ after ``max_write_s``; P frees when every reading D rank confirmed (``ReadDone``
rides on the READ, ``ReadFailed`` comes over the side channel) or when the lease ends.
Both sides' transitions are in the two tables below.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

import numpy as np

from .actions import FailTransfer, FinishLoad, FreeBlocks, SendMessage
from .errors import PlanError
from .machine import Entry, Rule, StateMachine, Step, clock_behind_reason
from .messages import PullOffer, RankRegions, ReadDone, ReadFailed, TransferId
from .plan import WritePlan, plan_rank_write, target_ranks, writer_ranks


# -- P: the lender ---------------------------------------------------------------------------------------
class LState(enum.Enum):
    NEW = "new"
    HELD = "held"          # offered; readers may be reading
    RELEASED = "released"  # every reader confirmed
    EXPIRED = "expired"    # the lease ended first


class LEvent(enum.Enum):
    OFFER = "offer"
    CONFIRMED = "confirmed"    # one reader confirmed, others owe theirs
    ALL_CONFIRMED = "all_confirmed"
    ABORT = "abort"
    EXPIRED = "expired"
    SUPERSEDED = "superseded"


class LEffect(enum.Enum):
    ARM_LEASE = "deadline := expires_at + max_write_s + clock_skew_allowance_s"
    FREE_BLOCKS = "free the offered blocks"
    FAIL = "report that nobody read the KV"
    FREE_LATE_BLOCKS = "free the blocks of an offer made after the transfer ended"
    DROP = "count"


_L, _LE, _LF = LState, LEvent, LEffect
LENDER_TABLE: dict[tuple[LState, LEvent], Rule] = {
    (_L.NEW, _LE.OFFER): Rule(_L.HELD, (_LF.ARM_LEASE,)),
    (_L.HELD, _LE.CONFIRMED): Rule(None),
    (_L.HELD, _LE.ALL_CONFIRMED): Rule(_L.RELEASED, (_LF.FREE_BLOCKS,)),
    (_L.HELD, _LE.EXPIRED): Rule(_L.EXPIRED, (_LF.FREE_BLOCKS, _LF.FAIL), "no decode read the KV within its lease"),
    (_L.HELD, _LE.ABORT): Rule(None, (_LF.DROP,)),  # a reader may be mid-READ: the lease decides
    (_L.HELD, _LE.SUPERSEDED): Rule(None),          # likewise
    (_L.NEW, _LE.SUPERSEDED): Rule(_L.RELEASED, (), "superseded by a newer attempt"),
}
for _end in (_L.RELEASED, _L.EXPIRED):
    LENDER_TABLE.update({(_end, e): Rule(None, (_LF.DROP,)) for e in (_LE.CONFIRMED, _LE.ALL_CONFIRMED, _LE.ABORT)})
    LENDER_TABLE[(_end, _LE.SUPERSEDED)] = Rule(None)
    LENDER_TABLE[(_end, _LE.OFFER)] = Rule(None, (_LF.FREE_LATE_BLOCKS,))  # nobody will read it


@dataclass
class Loan(Entry[LState]):
    offer: PullOffer | None = None
    block_ids: tuple[int, ...] = ()
    owed_by: set[int] | None = None  # D ranks still to confirm; known from the first confirmation
    d_tp_size: int = 0


class LenderCore(StateMachine[LState, LEvent, LEffect, Loan]):
    """P rank side of pull mode; called by P's pull lender thread."""

    TABLE, NEW, TERMINAL = LENDER_TABLE, LState.NEW, frozenset({LState.RELEASED, LState.EXPIRED})
    EXPIRED, SUPERSEDED = LEvent.EXPIRED, LEvent.SUPERSEDED

    def __init__(self, tp_rank: int, tp_size: int, max_read_s: float, clock_skew_allowance_s: float,
                 tombstone_s: float = 600.0, strict: bool = False, total_heads: int | None = None):
        super().__init__(tombstone_s=tombstone_s, strict=strict)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.max_read_s, self.skew_s = max_read_s, clock_skew_allowance_s
        self.total_heads = total_heads  # the model's KV heads: ranks may hold replicas (plan.writer_ranks)

    def _new_entry(self, transfer_id: TransferId, now: float) -> Loan:
        return Loan(transfer_id, LState.NEW, now)

    def offer(self, offer: PullOffer, now: float) -> list:
        """Prefill finished; ``offer`` (built by the caller) lends its blocks to whoever reads."""
        step = Step(self._clock(now), payload=offer)
        self._fire(self._entry(offer.transfer_id, step, create=True), LEvent.OFFER, step)
        return step.actions

    def confirmed(self, message: ReadDone | ReadFailed, now: float) -> list:
        step = Step(self._clock(now), payload=message)
        entry = self._entry(message.transfer_id, step, create=False)
        name = type(message).__name__.lower()
        if entry is None or entry.state is not LState.HELD:
            self._drop(f"{name}:{'unknown' if entry is None else entry.state.value}")
            return step.actions
        if entry.owed_by is None:
            entry.owed_by = set(target_ranks(self.tp_rank, self.tp_size, message.d_tp_size, self.total_heads))
            entry.d_tp_size = message.d_tp_size
        if message.d_rank not in entry.owed_by or message.d_tp_size != entry.d_tp_size:
            self._drop(f"{name}:not_owed")
            return step.actions
        entry.owed_by.discard(message.d_rank)
        self._fire(entry, LEvent.CONFIRMED if entry.owed_by else LEvent.ALL_CONFIRMED, step)
        return step.actions

    def abort(self, transfer_id: TransferId, reason: str, now: float) -> list:
        step = Step(self._clock(now), reason=reason)
        entry = self._entry(transfer_id, step, create=False)
        if entry is not None:
            self._fire(entry, LEvent.ABORT, step)
        return step.actions

    def tick(self, now: float) -> list:
        return self._tick(now)

    def _run_effect(self, entry: Loan, effect: LEffect, step: Step) -> None:
        if effect is LEffect.ARM_LEASE:
            entry.offer, entry.block_ids = step.payload, step.payload.block_ids
            entry.deadline = step.payload.expires_at + self.max_read_s + self.skew_s
        elif effect is LEffect.FREE_BLOCKS:
            step.actions.append(FreeBlocks(entry.transfer_id, entry.block_ids))
        elif effect is LEffect.FAIL:
            step.actions.append(FailTransfer(entry.transfer_id, step.reason or "expired"))
        elif effect is LEffect.FREE_LATE_BLOCKS:
            self._drop("offer:after_end")
            step.actions.append(FreeBlocks(entry.transfer_id, step.payload.block_ids))
        elif effect is LEffect.DROP:
            self._drop(f"{type(step.payload).__name__.lower()}:{entry.state.value}")


# -- D: the reader ----------------------------------------------------------------------------------------
class RState(enum.Enum):
    NEW = "new"
    WAITING = "waiting"        # offer known; our blocks not allocated yet
    READING = "reading"
    ABORTING = "aborting"      # aborted mid-READ: blocks stay ours until the READ ends
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class REvent(enum.Enum):
    OFFER = "offer"
    ALLOCATED = "allocated"
    READ_DONE = "read_done"
    READ_FAILED = "read_failed"
    ABORT = "abort"
    EXPIRED = "expired"
    SUPERSEDED = "superseded"
    CLOCK_BEHIND = "clock_behind"  # the offer was sent from our future: its expiry means nothing here


class REffect(enum.Enum):
    ARM_OFFER = "deadline := the offer's expiry"
    SUBMIT_READ = "plan and post the READs; deadline := now + max_write_s"
    ABORT_READ = "release in-flight READs"
    FREE_BLOCKS = "free our destination blocks"
    TELL_P_FAILED = "tell P: ReadFailed"
    FINISH_LOAD = "hand the request to the engine"
    FAIL = "fail the request upstream"
    FREE_LATE_BLOCKS = "free blocks allocated after the transfer ended"
    DROP = "count"


_R, _RE, _RF = RState, REvent, REffect
READER_TABLE: dict[tuple[RState, REvent], Rule] = {
    (_R.NEW, _RE.OFFER): Rule(_R.WAITING, (_RF.ARM_OFFER,)),
    (_R.NEW, _RE.SUPERSEDED): Rule(_R.CANCELLED),
    (_R.NEW, _RE.CLOCK_BEHIND): Rule(_R.FAILED, (_RF.ARM_OFFER, _RF.TELL_P_FAILED, _RF.FAIL)),
    (_R.WAITING, _RE.ALLOCATED): Rule(_R.READING, (_RF.SUBMIT_READ,)),
    (_R.WAITING, _RE.ABORT): Rule(_R.CANCELLED, (_RF.TELL_P_FAILED,)),
    (_R.WAITING, _RE.SUPERSEDED): Rule(_R.CANCELLED, (_RF.TELL_P_FAILED,), "superseded by a newer attempt"),
    (_R.WAITING, _RE.EXPIRED): Rule(
        _R.FAILED, (_RF.TELL_P_FAILED, _RF.FAIL), "prefill's offer expired before decode allocated blocks"),
    (_R.READING, _RE.READ_DONE): Rule(_R.DONE, (_RF.FINISH_LOAD,)),  # ReadDone rode on the READ
    (_R.READING, _RE.READ_FAILED): Rule(_R.FAILED, (_RF.FREE_BLOCKS, _RF.TELL_P_FAILED, _RF.FAIL)),
    (_R.READING, _RE.EXPIRED): Rule(
        _R.FAILED, (_RF.ABORT_READ, _RF.FREE_BLOCKS, _RF.TELL_P_FAILED, _RF.FAIL),
        "read did not finish within max_write_s"),
    (_R.READING, _RE.ABORT): Rule(_R.ABORTING),
    (_R.READING, _RE.SUPERSEDED): Rule(_R.ABORTING),
    (_R.ABORTING, _RE.READ_DONE): Rule(_R.CANCELLED, (_RF.FREE_BLOCKS,)),
    (_R.ABORTING, _RE.READ_FAILED): Rule(_R.CANCELLED, (_RF.FREE_BLOCKS, _RF.TELL_P_FAILED)),
    (_R.ABORTING, _RE.EXPIRED): Rule(_R.CANCELLED, (_RF.ABORT_READ, _RF.FREE_BLOCKS, _RF.TELL_P_FAILED)),
    (_R.ABORTING, _RE.ABORT): Rule(None, (_RF.DROP,)),
    (_R.ABORTING, _RE.SUPERSEDED): Rule(None),
    (_R.WAITING, _RE.OFFER): Rule(None, (_RF.DROP,)),
    (_R.READING, _RE.OFFER): Rule(None, (_RF.DROP,)),
}
for _end in (_R.DONE, _R.FAILED, _R.CANCELLED):
    READER_TABLE.update({(_end, e): Rule(None, (_RF.DROP,)) for e in (_RE.OFFER, _RE.ABORT, _RE.READ_DONE, _RE.READ_FAILED)})
    READER_TABLE[(_end, _RE.SUPERSEDED)] = Rule(None)
    READER_TABLE[(_end, _RE.ALLOCATED)] = Rule(None, (_RF.FREE_LATE_BLOCKS,))  # e.g. the offer lapsed


@dataclass
class Read(Entry[RState]):
    offer: PullOffer | None = None
    local: RankRegions | None = None
    block_ids: tuple[int, ...] = ()
    first_block_index: int = 0


@dataclass(frozen=True, slots=True)
class SubmitRead:
    """D: post one READ per P rank in ``plans`` (p_rank -> plan); each carries ``notification``.
    Report the outcome as ``read_done`` or ``read_failed`` on the reader core."""

    transfer_id: TransferId
    plans: dict[int, WritePlan] = field(hash=False)
    p_side_channel: str = ""
    notification: ReadDone | None = None


@dataclass(frozen=True, slots=True)
class AbortRead:
    transfer_id: TransferId


class ReaderCore(StateMachine[RState, REvent, REffect, Read]):
    """D rank side of pull mode; called by D's pull reader thread."""

    TABLE, NEW, TERMINAL = READER_TABLE, RState.NEW, frozenset({RState.DONE, RState.FAILED, RState.CANCELLED})
    EXPIRED, SUPERSEDED = REvent.EXPIRED, REvent.SUPERSEDED

    def __init__(self, tp_rank: int, tp_size: int, max_read_s: float, tombstone_s: float = 600.0,
                 strict: bool = False, total_heads: int | None = None, clock_skew_allowance_s: float = 1.0):
        super().__init__(tombstone_s=tombstone_s, strict=strict)
        self.tp_rank, self.tp_size, self.max_read_s = tp_rank, tp_size, max_read_s
        self.skew_s = clock_skew_allowance_s
        self.total_heads = total_heads  # the model's KV heads: ranks may hold replicas (plan.writer_ranks)

    def _new_entry(self, transfer_id: TransferId, now: float) -> Read:
        return Read(transfer_id, RState.NEW, now)

    def offered(self, offer: PullOffer, now: float) -> list:
        """The decode leg arrived with P's (verified) offer."""
        step = Step(self._clock(now), payload=offer)
        entry = self._entry(offer.transfer_id, step, create=True)
        if offer.sent_at - step.now > self.skew_s and entry.state is RState.NEW:  # we would READ past P's lease
            step.reason = clock_behind_reason("decode", "prefill", offer.sent_at, step.now, self.skew_s)
            self._fire(entry, REvent.CLOCK_BEHIND, step)
        else:
            self._fire(entry, REvent.OFFER, step)
        return step.actions

    def allocated(self, transfer_id: TransferId, local: RankRegions, block_ids: tuple[int, ...],
                  first_block_index: int, now: float) -> list:
        """Our scheduler allocated ``block_ids`` for prompt blocks ``first_block_index`` onwards."""
        step = Step(self._clock(now), payload=(local, tuple(block_ids), first_block_index))
        entry = self._entry(transfer_id, step, create=False)
        if entry is None:
            self._drop("allocated:unknown")
            return []
        self._fire(entry, REvent.ALLOCATED, step)
        return step.actions

    def read_done(self, transfer_id: TransferId, now: float) -> list:
        return self._local(transfer_id, REvent.READ_DONE, now, None)

    def read_failed(self, transfer_id: TransferId, reason: str, now: float) -> list:
        return self._local(transfer_id, REvent.READ_FAILED, now, reason)

    def abort(self, transfer_id: TransferId, reason: str, now: float) -> list:
        return self._local(transfer_id, REvent.ABORT, now, reason)

    def tick(self, now: float) -> list:
        return self._tick(now)

    def _local(self, transfer_id, event, now, reason):
        step = Step(self._clock(now), reason=reason)
        entry = self._entry(transfer_id, step, create=False)
        if entry is None:
            self._drop(f"{event.value}:unknown")
            return []
        self._fire(entry, event, step)
        return step.actions

    def _sources(self, offer: PullOffer) -> tuple[int, ...]:
        """The P ranks this rank reads from: each of its heads from one of them."""
        return writer_ranks(self.tp_rank, self.tp_size, offer.p_tp_size, self.total_heads)

    def _plans(self, entry: Read) -> dict[int, WritePlan]:
        offer, local = entry.offer, entry.local
        first, dst = entry.first_block_index, np.asarray(entry.block_ids, dtype=np.int64)
        if first < 0 or first + len(dst) != len(offer.block_ids):
            raise PlanError(f"decode allocated blocks {first}..{first + len(dst) - 1} for a request "
                            f"that holds {len(offer.block_ids)} blocks on prefill")
        src = np.asarray(offer.block_ids[first:], dtype=np.int64)
        p_ranks = {r.tp_rank: r for r in offer.ranks}
        plans = {}
        for p_rank in self._sources(offer):
            if p_rank not in p_ranks:
                raise PlanError(f"the offer lacks prefill rank {p_rank} of {offer.p_tp_size}")
            if len(dst):
                write = plan_rank_write(p_ranks[p_rank].regions, local, src, dst)
                plans[p_rank] = WritePlan((replace(write, remote_agent=p_ranks[p_rank].agent_name),))
            else:
                plans[p_rank] = WritePlan(())
        return plans

    def _run_effect(self, entry: Read, effect: REffect, step: Step) -> None:
        tid = entry.transfer_id
        if effect is REffect.ARM_OFFER:
            entry.offer, entry.deadline = step.payload, step.payload.expires_at
        elif effect is REffect.SUBMIT_READ:
            entry.local, entry.block_ids, entry.first_block_index = step.payload
            try:
                plans = self._plans(entry)
            except PlanError as exc:
                self.counters["offer_rejected"] += 1
                self._fire(entry, REvent.READ_FAILED, Step(step.now, f"offer rejected: {exc}", actions=step.actions))
                return
            entry.deadline = step.now + self.max_read_s
            step.actions.append(SubmitRead(tid, plans, entry.offer.p_side_channel,
                                           ReadDone(tid, self.tp_rank, self.tp_size)))
        elif effect is REffect.ABORT_READ:
            step.actions.append(AbortRead(tid))
        elif effect is REffect.FREE_BLOCKS:
            step.actions.append(FreeBlocks(tid, entry.block_ids))
        elif effect is REffect.TELL_P_FAILED:
            offer = entry.offer
            step.actions.append(SendMessage(
                offer.p_side_channel, self._sources(offer),
                ReadFailed(tid, self.tp_rank, self.tp_size, step.reason or entry.reason or "decode gave up")))
        elif effect is REffect.FINISH_LOAD:
            step.actions.append(FinishLoad(tid))
        elif effect is REffect.FAIL:
            step.actions.append(FailTransfer(tid, step.reason or entry.reason or "failed"))
        elif effect is REffect.FREE_LATE_BLOCKS:
            self._drop("allocated:after_end")
            step.actions.append(FreeBlocks(tid, step.payload[1]))
        elif effect is REffect.DROP:
            self._drop(f"{type(step.payload).__name__.lower()}:{entry.state.value}")
