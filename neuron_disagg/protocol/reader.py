"""Pull mode, D's side of one tensor-parallel rank: the reader.

D learns P's offer with the decode leg, allocates, then READs from every P rank whose heads it
needs, off its engine loop. The fencing mirrors push: D starts no READ after the offer's
``expires_at`` (refusing outright an offer stamped in its own future beyond the clock skew
allowance) and gives up on a READ after ``max_read_s``. Giving up does not stop a READ (NIXL
cannot cancel an RDMA op in flight), so D's blocks stay out of vLLM's hands until the READ ends,
or until a second ``max_read_s`` has passed; only then does D tell P. As in push, D probes the P
ranks it reads from (``liveness.py``): when one is gone, the request goes on at once without the KV
(``Quarantine``) and the blocks wait for the READ's end as before. Every transition is in
``TABLE``; the core does no I/O and is called only by D's pull reader thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import numpy as np

from .actions import AbortRead, Action, FailTransfer, FinishLoad, FreeBlocks, Quarantine, SendMessage, SubmitRead
from .liveness import PeerWatch
from .errors import PlanError
from .machine import LATE_ALLOCATION, Entry, Rule, StateMachine, Step, clock_behind_reason, refuse_late_allocation
from .messages import PullOffer, RankRegions, ReadDone, ReadFailed, TransferId
from .plan import WritePlan, plan_rank_write, writer_ranks
from .timeouts import DEFAULTS


class RState(enum.Enum):
    NEW = "new"
    WAITING = "waiting"        # offer known; our blocks not allocated yet
    READING = "reading"
    ABORTING = "aborting"      # aborted mid-READ: blocks stay ours until the READ ends
    DRAINING = "draining"      # gave up on the READ: blocks stay ours until it ends; then recompute
    QUARANTINED = "quarantined"  # P is gone: the request went on without the KV; blocks wait for the READ
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
    SUSPECTED = "suspected"    # a P rank we read from is gone (liveness.py): only while we wait on P


class REffect(enum.Enum):
    ARM_OFFER = "deadline := the offer's expiry"
    KEEP_OFFER = "remember the offer, to tell P (no deadline: the transfer has ended)"
    SUBMIT_READ = "plan and post the READs; deadline := now + max_read_s"
    DRAIN = "deadline := the READ's deadline + max_read_s"
    ABORT_READ = "release in-flight READs"
    FREE_BLOCKS = "free our destination blocks"
    TELL_P_FAILED = "tell P: ReadFailed"
    FINISH_LOAD = "hand the request to the engine"
    FAIL = "fail the request upstream"
    FREE_LATE_BLOCKS = "free blocks allocated after the transfer ended"
    QUARANTINE = "the request goes on without the KV now; the blocks wait for the READ"
    COUNT_LATE_LANDING = "count a READ that landed in quarantined blocks (never decoded)"
    DROP = "count"


S, E, F = RState, REvent, REffect
TIMED_OUT = "read did not finish within max_read_s"
TABLE: dict[tuple[RState, REvent], Rule[RState, REffect]] = {
    (S.NEW, E.OFFER): Rule(S.WAITING, (F.ARM_OFFER,)),
    (S.NEW, E.SUPERSEDED): Rule(S.CANCELLED),
    # Not ARM_OFFER: a deadline on an ended transfer would fire EXPIRED, which no ended state takes.
    (S.NEW, E.CLOCK_BEHIND): Rule(S.FAILED, (F.KEEP_OFFER, F.TELL_P_FAILED, F.FAIL)),
    (S.WAITING, E.ALLOCATED): Rule(S.READING, (F.SUBMIT_READ,)),
    (S.WAITING, E.ABORT): Rule(S.CANCELLED, (F.TELL_P_FAILED,)),
    (S.WAITING, E.SUPERSEDED): Rule(S.CANCELLED, (F.TELL_P_FAILED,), "superseded by a newer attempt"),
    (S.WAITING, E.EXPIRED): Rule(
        S.FAILED, (F.TELL_P_FAILED, F.FAIL), "prefill's offer expired before decode allocated blocks"),
    (S.READING, E.READ_DONE): Rule(S.DONE, (F.FINISH_LOAD,)),  # ReadDone rode on the READ
    # FAIL before FREE_BLOCKS: the worker ends the transfer when its blocks are freed and reports
    # it to vLLM then, as loaded unless it already knows the load failed (consumer.py does the same).
    (S.READING, E.READ_FAILED): Rule(S.FAILED, (F.FAIL, F.FREE_BLOCKS, F.TELL_P_FAILED)),
    (S.READING, E.EXPIRED): Rule(S.DRAINING, (F.DRAIN,), TIMED_OUT),
    (S.READING, E.ABORT): Rule(S.ABORTING, (F.DRAIN,)),
    (S.READING, E.SUPERSEDED): Rule(S.ABORTING, (F.DRAIN,)),
    # Even a READ that completes now is not trusted: P's lease may have ended while it ran.
    (S.DRAINING, E.READ_DONE): Rule(S.FAILED, (F.FAIL, F.FREE_BLOCKS, F.TELL_P_FAILED), TIMED_OUT),
    (S.DRAINING, E.READ_FAILED): Rule(S.FAILED, (F.FAIL, F.FREE_BLOCKS, F.TELL_P_FAILED), TIMED_OUT),
    (S.DRAINING, E.EXPIRED): Rule(
        S.FAILED, (F.ABORT_READ, F.FAIL, F.FREE_BLOCKS, F.TELL_P_FAILED), TIMED_OUT),
    (S.DRAINING, E.ABORT): Rule(S.ABORTING),
    (S.DRAINING, E.SUPERSEDED): Rule(S.ABORTING),
    (S.DRAINING, E.OFFER): Rule(None, (F.DROP,)),
    (S.ABORTING, E.READ_DONE): Rule(S.CANCELLED, (F.FREE_BLOCKS,)),
    (S.ABORTING, E.READ_FAILED): Rule(S.CANCELLED, (F.FREE_BLOCKS, F.TELL_P_FAILED)),
    (S.ABORTING, E.EXPIRED): Rule(S.CANCELLED, (F.ABORT_READ, F.FREE_BLOCKS, F.TELL_P_FAILED)),
    (S.ABORTING, E.ABORT): Rule(None, (F.DROP,)),
    (S.ABORTING, E.SUPERSEDED): Rule(None),
    (S.WAITING, E.OFFER): Rule(None, (F.DROP,)),
    (S.READING, E.OFFER): Rule(None, (F.DROP,)),
    # -- a P rank we wait on is gone: recover now, hold the blocks until the READ is over ------
    (S.WAITING, E.SUSPECTED): Rule(S.FAILED, (F.TELL_P_FAILED, F.FAIL)),
    (S.READING, E.SUSPECTED): Rule(S.QUARANTINED, (F.DRAIN, F.QUARANTINE)),
    (S.DRAINING, E.SUSPECTED): Rule(S.QUARANTINED, (F.QUARANTINE,)),
    (S.QUARANTINED, E.READ_DONE): Rule(S.FAILED, (F.COUNT_LATE_LANDING, F.FREE_BLOCKS, F.TELL_P_FAILED)),
    (S.QUARANTINED, E.READ_FAILED): Rule(S.FAILED, (F.FREE_BLOCKS, F.TELL_P_FAILED)),
    (S.QUARANTINED, E.EXPIRED): Rule(S.FAILED, (F.ABORT_READ, F.FREE_BLOCKS, F.TELL_P_FAILED)),
    (S.QUARANTINED, E.ABORT): Rule(None, (F.DROP,)),
    (S.QUARANTINED, E.SUPERSEDED): Rule(None),
    (S.QUARANTINED, E.OFFER): Rule(None, (F.DROP,)),
}
for _end in (S.DONE, S.FAILED, S.CANCELLED):
    TABLE.update({(_end, e): Rule(None, (F.DROP,)) for e in (E.OFFER, E.ABORT, E.READ_DONE, E.READ_FAILED)})
    TABLE[(_end, E.SUPERSEDED)] = Rule(None)
    # e.g. the offer lapsed, or a request of the same prompt and kv_transfer_params came after
    # this transfer ended: nothing will fill these blocks, so the load fails (D computes it).
    TABLE[(_end, E.ALLOCATED)] = Rule(None, (F.FAIL, F.FREE_LATE_BLOCKS), LATE_ALLOCATION)


@dataclass(frozen=True, kw_only=True)
class ReaderTimeouts:
    max_read_s: float = DEFAULTS.max_read_s  # give up on a READ that takes longer; its blocks wait as long again for it
    clock_skew_allowance_s: float = DEFAULTS.clock_skew_allowance_s
    tombstone_s: float = DEFAULTS.tombstone_s
    suspect_after_s: float = DEFAULTS.suspect_after_s


@dataclass
class Read(Entry[RState]):
    offer: PullOffer | None = None
    local: RankRegions | None = None
    block_ids: tuple[int, ...] = ()
    first_block_index: int = 0


class ReaderCore(StateMachine[RState, REvent, REffect, Read]):
    """D rank side of pull mode; called by D's pull reader thread."""

    TABLE, NEW, TERMINAL = TABLE, RState.NEW, frozenset({RState.DONE, RState.FAILED, RState.CANCELLED})
    EXPIRED, SUPERSEDED, SUSPECTED = REvent.EXPIRED, REvent.SUPERSEDED, REvent.SUSPECTED

    def __init__(self, tp_rank: int, tp_size: int, timeouts: ReaderTimeouts = ReaderTimeouts(),
                 strict: bool = False, total_heads: int | None = None):
        super().__init__(tombstone_s=timeouts.tombstone_s, strict=strict)
        self.tp_rank, self.tp_size, self.timeouts = tp_rank, tp_size, timeouts
        self.total_heads = total_heads  # the model's KV heads: ranks may hold replicas (plan.writer_ranks)
        self.watch = PeerWatch(timeouts.suspect_after_s)

    def _new_entry(self, transfer_id: TransferId, now: float) -> Read:
        return Read(transfer_id, RState.NEW, now)

    def offered(self, offer: PullOffer, now: float) -> list[Action]:
        """The decode leg arrived with P's (verified) offer."""
        step = Step(self._clock(now), payload=offer)
        entry = self._entry(offer.transfer_id, step, create=True)
        skew_s = self.timeouts.clock_skew_allowance_s
        if offer.sent_at - step.now > skew_s and entry.state is RState.NEW:  # we would READ past P's lease
            step.reason = clock_behind_reason("decode", "prefill", offer.sent_at, step.now, skew_s)
            self._fire(entry, REvent.CLOCK_BEHIND, step)
        else:
            self._fire(entry, REvent.OFFER, step)
        return step.actions

    def allocated(self, transfer_id: TransferId, local: RankRegions, block_ids: tuple[int, ...],
                  first_block_index: int, now: float) -> list[Action]:
        """Our scheduler allocated ``block_ids`` for prompt blocks ``first_block_index`` onwards."""
        step = Step(self._clock(now), payload=(local, tuple(block_ids), first_block_index))
        entry = self._entry(transfer_id, step, create=False)
        if entry is None:  # forgotten (its tombstone lapsed): the blocks must not wait for it
            self._drop("allocated:unknown")
            return refuse_late_allocation(transfer_id, block_ids)
        self._fire(entry, REvent.ALLOCATED, step)
        return step.actions

    def read_done(self, transfer_id: TransferId, now: float) -> list[Action]:
        return self._local(transfer_id, REvent.READ_DONE, now, None)

    def read_failed(self, transfer_id: TransferId, reason: str, now: float) -> list[Action]:
        return self._local(transfer_id, REvent.READ_FAILED, now, reason)

    def abort(self, transfer_id: TransferId, reason: str, now: float) -> list[Action]:
        return self._local(transfer_id, REvent.ABORT, now, reason)

    def tick(self, now: float) -> list[Action]:
        actions = self._tick(now)
        self._watch_peers(Step(self._now, actions=actions))
        return actions

    def _waits_on(self, entry: Read) -> tuple[tuple[str, int], ...]:
        if entry.state not in (RState.WAITING, RState.READING, RState.DRAINING) or entry.offer is None:
            return ()
        return tuple((entry.offer.p_side_channel, rank) for rank in self._sources(entry.offer))

    def _local(self, transfer_id: TransferId, event: REvent, now: float, reason: str | None) -> list[Action]:
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
        assert offer is not None and local is not None  # ARM_OFFER and SUBMIT_READ set them first
        first, dst = entry.first_block_index, np.asarray(entry.block_ids, dtype=np.int64)
        if first < 0 or first + len(dst) != len(offer.block_ids):
            raise PlanError(f"decode allocated blocks {first}..{first + len(dst) - 1} for a request "
                            f"that holds {len(offer.block_ids)} blocks on prefill")
        src = np.asarray(offer.block_ids[first:], dtype=np.int64)
        p_ranks = {r.tp_rank: r for r in offer.ranks}
        plans: dict[int, WritePlan] = {}
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
        elif effect is REffect.KEEP_OFFER:
            entry.offer = step.payload
        elif effect is REffect.SUBMIT_READ:
            entry.local, entry.block_ids, entry.first_block_index = step.payload
            try:
                plans = self._plans(entry)
            except PlanError as exc:
                self.counters["offer_rejected"] += 1
                self._fire(entry, REvent.READ_FAILED, Step(step.now, f"offer rejected: {exc}", actions=step.actions))
                return
            entry.deadline = step.now + self.timeouts.max_read_s
            assert entry.offer is not None  # _plans read it
            step.actions.append(SubmitRead(tid, plans, entry.offer.p_side_channel,
                                           ReadDone(tid, self.tp_rank, self.tp_size)))
        elif effect is REffect.DRAIN:
            assert entry.deadline is not None  # set by SUBMIT_READ: a READ is in flight
            entry.deadline += self.timeouts.max_read_s
        elif effect is REffect.ABORT_READ:
            step.actions.append(AbortRead(tid))
        elif effect is REffect.FREE_BLOCKS:
            step.actions.append(FreeBlocks(tid, entry.block_ids))
        elif effect is REffect.TELL_P_FAILED:
            offer = entry.offer
            assert offer is not None  # every state that tells P was entered with its offer (ARM_OFFER)
            step.actions.append(SendMessage(
                offer.p_side_channel, self._sources(offer),
                ReadFailed(tid, self.tp_rank, self.tp_size, step.reason or entry.reason or "decode gave up")))
        elif effect is REffect.FINISH_LOAD:
            step.actions.append(FinishLoad(tid))
        elif effect is REffect.FAIL:
            step.actions.append(FailTransfer(tid, step.reason or entry.reason or "failed"))
        elif effect is REffect.QUARANTINE:
            self.counters["quarantined"] += 1
            step.actions.append(Quarantine(tid, step.reason or entry.reason or "prefill gone"))
        elif effect is REffect.COUNT_LATE_LANDING:
            self.counters["landed_in_quarantine"] += 1
        elif effect is REffect.FREE_LATE_BLOCKS:
            self._drop("allocated:after_end")
            step.actions.append(FreeBlocks(tid, step.payload[1]))
        elif effect is REffect.DROP:
            self._drop(f"{type(step.payload).__name__.lower()}:{entry.state.value}")
