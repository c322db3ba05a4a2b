"""Pull mode, P's side of one tensor-parallel rank: the lender.

P offers its finished blocks (``PullOffer``, built by P's scheduler, relayed by the router) and
holds them under a lease: until every D rank that reads from this rank confirmed (``ReadDone``
rides on the READ, ``ReadFailed`` comes over the side channel), or until the offer's expiry plus
the longest a READ may take (``max_read_s``) and the clock skew allowance. Every transition is in
``TABLE``; the core does no I/O and is called only by P's pull lender thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .actions import Action, FailTransfer, FreeBlocks
from .machine import Entry, Rule, StateMachine, Step
from .messages import PullOffer, ReadDone, ReadFailed, TransferId
from .plan import target_ranks
from .timeouts import DEFAULTS


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


S, E, F = LState, LEvent, LEffect
TABLE: dict[tuple[LState, LEvent], Rule[LState, LEffect]] = {
    (S.NEW, E.OFFER): Rule(S.HELD, (F.ARM_LEASE,)),
    (S.HELD, E.CONFIRMED): Rule(None),
    (S.HELD, E.ALL_CONFIRMED): Rule(S.RELEASED, (F.FREE_BLOCKS,)),
    (S.HELD, E.EXPIRED): Rule(S.EXPIRED, (F.FREE_BLOCKS, F.FAIL), "lease expired: no decode read the KV within its lease"),
    (S.HELD, E.ABORT): Rule(None, (F.DROP,)),  # a reader may be mid-READ: the lease decides
    (S.HELD, E.SUPERSEDED): Rule(None),          # likewise
    (S.NEW, E.SUPERSEDED): Rule(S.RELEASED, (), "superseded by a newer attempt"),
    (S.HELD, E.WITHDRAWN): Rule(S.RELEASED, (F.FREE_BLOCKS,),
                                   "withdrawn by the router: no decode instance took the request"),
}
for _end in (S.RELEASED, S.EXPIRED):
    TABLE.update({(_end, e): Rule(None, (F.DROP,)) for e in (E.CONFIRMED, E.ALL_CONFIRMED, E.ABORT)})
    TABLE[(_end, E.SUPERSEDED)] = Rule(None)
    TABLE[(_end, E.WITHDRAWN)] = Rule(None)
    TABLE[(_end, E.OFFER)] = Rule(None, (F.FREE_LATE_BLOCKS,))  # nobody will read it


@dataclass(frozen=True, kw_only=True)
class LenderTimeouts:
    max_read_s: float = DEFAULTS.max_read_s  # a reader's READ may last this long after the offer's expiry
    clock_skew_allowance_s: float = DEFAULTS.clock_skew_allowance_s
    tombstone_s: float = DEFAULTS.tombstone_s


@dataclass
class Loan(Entry[LState]):
    offer: PullOffer | None = None
    block_ids: tuple[int, ...] = ()
    owed_by: set[int] | None = None  # D ranks still to confirm; known from the first confirmation
    d_tp_size: int = 0


class LenderCore(StateMachine[LState, LEvent, LEffect, Loan]):
    """P rank side of pull mode; called by P's pull lender thread."""

    TABLE, NEW, TERMINAL = TABLE, LState.NEW, frozenset({LState.RELEASED, LState.EXPIRED})
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
