"""Pull mode, P's side of one tensor-parallel rank: the lender.

P offers its finished blocks (``PullOffer``, built by P's scheduler, relayed by the router) and
holds them under a lease: until every D rank that reads from this rank confirmed (``ReadDone``
rides on the READ, ``ReadFailed`` comes over the side channel), or until the offer's expiry plus
the longest a READ may take (``max_read_s``) and the clock skew allowance. Every transition is in
``LENDER_TABLE``; the core does no I/O and is called only by P's pull lender thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .actions import Action, FailTransfer, FreeBlocks
from .machine import Entry, Rule, StateMachine, Step
from .messages import PullOffer, ReadDone, ReadFailed, TransferId
from .plan import target_ranks


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
    WITHDRAWN = "withdrawn"    # the router: no D took the request, so nobody reads (Withdraw)


class LEffect(enum.Enum):
    ARM_LEASE = "deadline := expires_at + max_read_s + clock_skew_allowance_s"
    FREE_BLOCKS = "free the offered blocks"
    FAIL = "report that nobody read the KV"
    FREE_LATE_BLOCKS = "free the blocks of an offer made after the transfer ended"
    DROP = "count"


_L, _LE, _LF = LState, LEvent, LEffect
LENDER_TABLE: dict[tuple[LState, LEvent], Rule] = {
    (_L.NEW, _LE.OFFER): Rule(_L.HELD, (_LF.ARM_LEASE,)),
    (_L.HELD, _LE.CONFIRMED): Rule(None),
    (_L.HELD, _LE.ALL_CONFIRMED): Rule(_L.RELEASED, (_LF.FREE_BLOCKS,)),
    (_L.HELD, _LE.EXPIRED): Rule(_L.EXPIRED, (_LF.FREE_BLOCKS, _LF.FAIL), "lease expired: no decode read the KV within its lease"),
    (_L.HELD, _LE.ABORT): Rule(None, (_LF.DROP,)),  # a reader may be mid-READ: the lease decides
    (_L.HELD, _LE.SUPERSEDED): Rule(None),          # likewise
    (_L.NEW, _LE.SUPERSEDED): Rule(_L.RELEASED, (), "superseded by a newer attempt"),
    (_L.HELD, _LE.WITHDRAWN): Rule(_L.RELEASED, (_LF.FREE_BLOCKS,),
                                   "withdrawn by the router: no decode instance took the request"),
}
for _end in (_L.RELEASED, _L.EXPIRED):
    LENDER_TABLE.update({(_end, e): Rule(None, (_LF.DROP,)) for e in (_LE.CONFIRMED, _LE.ALL_CONFIRMED, _LE.ABORT)})
    LENDER_TABLE[(_end, _LE.SUPERSEDED)] = Rule(None)
    LENDER_TABLE[(_end, _LE.WITHDRAWN)] = Rule(None)
    LENDER_TABLE[(_end, _LE.OFFER)] = Rule(None, (_LF.FREE_LATE_BLOCKS,))  # nobody will read it


@dataclass(frozen=True)
class LenderTimeouts:
    max_read_s: float = 30.0  # a reader's READ may last this long after the offer's expiry
    clock_skew_allowance_s: float = 1.0
    tombstone_s: float = 600.0


@dataclass
class Loan(Entry[LState]):
    offer: PullOffer | None = None
    block_ids: tuple[int, ...] = ()
    owed_by: set[int] | None = None  # D ranks still to confirm; known from the first confirmation
    d_tp_size: int = 0


class LenderCore(StateMachine[LState, LEvent, LEffect, Loan]):
    """P rank side of pull mode; called by P's pull lender thread."""

    TABLE, NEW, TERMINAL = LENDER_TABLE, LState.NEW, frozenset({LState.RELEASED, LState.EXPIRED})
    EXPIRED, SUPERSEDED, WITHDRAWN = LEvent.EXPIRED, LEvent.SUPERSEDED, LEvent.WITHDRAWN

    def __init__(self, tp_rank: int, tp_size: int, timeouts: LenderTimeouts = LenderTimeouts(),
                 strict: bool = False, total_heads: int | None = None):
        super().__init__(tombstone_s=timeouts.tombstone_s, strict=strict)
        self.tp_rank, self.tp_size, self.timeouts = tp_rank, tp_size, timeouts
        self.total_heads = total_heads  # the model's KV heads: ranks may hold replicas (plan.writer_ranks)

    def _new_entry(self, transfer_id: TransferId, now: float) -> Loan:
        return Loan(transfer_id, LState.NEW, now)

    def offer(self, offer: PullOffer, now: float) -> list[Action]:
        """Prefill finished; ``offer`` (built by the caller) lends its blocks to whoever reads."""
        step = Step(self._clock(now), payload=offer)
        entry = self._entry(offer.transfer_id, step, create=True)
        self._fire(entry, LEvent.OFFER, step)
        self._if_withdrawn(entry, step)
        return step.actions

    def confirmed(self, message: ReadDone | ReadFailed, now: float) -> list[Action]:
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

    def abort(self, transfer_id: TransferId, reason: str, now: float) -> list[Action]:
        step = Step(self._clock(now), reason=reason)
        entry = self._entry(transfer_id, step, create=False)
        if entry is not None:
            self._fire(entry, LEvent.ABORT, step)
        return step.actions

    def tick(self, now: float) -> list[Action]:
        return self._tick(now)

    def _run_effect(self, entry: Loan, effect: LEffect, step: Step) -> None:
        if effect is LEffect.ARM_LEASE:
            entry.offer, entry.block_ids = step.payload, step.payload.block_ids
            t = self.timeouts
            entry.deadline = step.payload.expires_at + t.max_read_s + t.clock_skew_allowance_s
        elif effect is LEffect.FREE_BLOCKS:
            step.actions.append(FreeBlocks(entry.transfer_id, entry.block_ids))
        elif effect is LEffect.FAIL:
            step.actions.append(FailTransfer(entry.transfer_id, step.reason or "expired"))
        elif effect is LEffect.FREE_LATE_BLOCKS:
            self._drop("offer:after_end")
            step.actions.append(FreeBlocks(entry.transfer_id, step.payload.block_ids))
        elif effect is LEffect.DROP:
            self._drop(f"{type(step.payload).__name__.lower()}:{entry.state.value}")
