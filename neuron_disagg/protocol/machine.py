"""The machinery both sides' state machines share: table lookup, strictness, time, tombstones and
supersession. The tables themselves live in ``producer.py`` and ``consumer.py`` (push), ``lender.py``
and ``reader.py`` (pull), each the module's ``TABLE``.

An entry is one transfer on one side, with an explicit state and at most one deadline. The owner
feeds events with the current time; when an entry's deadline has passed, its EXPIRED event fires
before anything else is applied to it, so no write is ever issued on a lapsed registration or lease.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, overload

from .actions import Action, FailTransfer, FreeBlocks, Transitioned
from .errors import ProtocolError
from .liveness import PeerRank, PeerWatch
from .messages import TransferId
from .rules import Rule as Rule  # re-exported: each side's table imports it from here

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)
F = TypeVar("F", bound=enum.Enum)


@dataclass
class Entry(Generic[S]):
    transfer_id: TransferId
    state: S
    created_at: float
    deadline: float | None = None
    reason: str | None = None
    ended_at: float | None = None


EntryT = TypeVar("EntryT", bound=Entry[Any])


@dataclass
class Step:
    """The context of one event as its effects run: what arrived and what must be sent out."""

    now: float
    reason: str | None = None
    payload: Any = None
    actions: list[Action] = field(default_factory=list)


#: D's cores, for blocks allocated for a transfer that has ended (or was never known): the load fails.
LATE_ALLOCATION = "blocks allocated after this transfer ended: nothing will fill them"


def refuse_late_allocation(transfer_id: TransferId, block_ids: tuple[int, ...]) -> list[Action]:
    """D's cores, for blocks allocated for a transfer they hold no entry of: fail the load, then
    free those blocks (never offered to P, so nothing can land in them); the worker reports a load
    when its blocks are freed, so the failure comes first."""
    return [FailTransfer(transfer_id, LATE_ALLOCATION), FreeBlocks(transfer_id, tuple(block_ids))]


def clock_behind_reason(me: str, them: str, their_clock: float, my_clock: float, allowance_s: float) -> str:
    """Why ``me`` refused a message ``them`` stamped in ``me``'s future beyond the allowance. What
    precedes the first colon is the metrics' reason label."""
    return (f"clock skew: {me}'s clock ({my_clock:.3f}) is {their_clock - my_clock:.2f} s behind {them}'s ({their_clock:.3f}), "
            f"over clock_skew_allowance_s ({allowance_s} s): deadlines across the two cannot be trusted; "
            "synchronise the hosts' clocks (chrony; `neuron-disagg doctor` checks the offset)")


class StateMachine(Generic[S, E, F, EntryT]):
    """One side's transfers. Subclasses provide TABLE, NEW, TERMINAL, EXPIRED, SUPERSEDED and
    ``_run_effect``; they expose one public method per event."""

    TABLE: dict[tuple[S, E], Rule[S, F]]
    NEW: Any
    TERMINAL: frozenset[S]
    EXPIRED: Any
    SUPERSEDED: Any
    WITHDRAWN: Any = None  # P's cores only: the router's Withdraw
    SUSPECTED: Any = None  # D's cores only: a peer rank the transfer waits on is gone
    watch: PeerWatch | None = None  # D's cores: the peer ranks live transfers wait on

    def __init__(self, *, tombstone_s: float, strict: bool = False):
        self.entries: dict[TransferId, EntryT] = {}
        self.counters: Counter[str] = Counter()
        self.strict = strict
        self._tombstone_s = tombstone_s
        self._now = float("-inf")
        self._latest_attempt: dict[tuple[str, str], int] = {}
        self._attempts: dict[tuple[str, str], set[TransferId]] = {}  # lineage -> its attempts we hold
        self._withdrawn: dict[TransferId, float] = {}      # router attempts no D takes -> when told

    # -- time ------------------------------------------------------------------------------------
    def _clock(self, now: float) -> float:
        """Time never runs backwards inside a core: a clock stepped back keeps the latest time."""
        self._now = max(self._now, now)
        return self._now

    # -- lookup ----------------------------------------------------------------------------------
    def _new_entry(self, transfer_id: TransferId, now: float) -> EntryT:
        raise NotImplementedError

    @overload
    def _entry(self, transfer_id: TransferId, step: Step, create: Literal[True]) -> EntryT: ...
    @overload
    def _entry(self, transfer_id: TransferId, step: Step, create: bool) -> EntryT | None: ...

    def _entry(self, transfer_id: TransferId, step: Step, create: bool) -> EntryT | None:
        entry = self.entries.get(transfer_id)
        if entry is None:
            if not create:
                return None
            entry = self._new_entry(transfer_id, step.now)
            self.entries[transfer_id] = entry
            self._attempts.setdefault(transfer_id.lineage, set()).add(transfer_id)
        self._supersede(entry, step)
        self._expire_if_due(entry, step)
        if self.entries.get(transfer_id) is not entry:  # expired back to NEW: forgotten; begin afresh
            return self._entry(transfer_id, step, create)
        return entry

    def _supersede(self, entry: EntryT, step: Step) -> None:
        """A newer attempt of the same request supersedes every older one (invariant I1)."""
        tid = entry.transfer_id
        latest = self._latest_attempt.get(tid.lineage, -1)
        if tid.attempt < latest:
            if entry.state not in self.TERMINAL:
                self._fire(entry, self.SUPERSEDED, step)
            return
        if tid.attempt > latest:
            self._latest_attempt[tid.lineage] = tid.attempt
            for other_id in self._attempts.get(tid.lineage, ()):
                other = self.entries[other_id]
                if tid.supersedes(other_id) and other.state not in self.TERMINAL:
                    self._fire(other, self.SUPERSEDED, Step(step.now, actions=step.actions))

    def _expire_if_due(self, entry: EntryT, step: Step) -> None:
        # After a long pause several deadlines may have lapsed in a row (watchdog, then fence).
        while entry.deadline is not None and step.now >= entry.deadline:
            deadline = entry.deadline
            self._fire(entry, self.EXPIRED, Step(step.now, actions=step.actions))
            if entry.deadline == deadline:  # a state whose deadline does not move on expiry
                break

    # -- transitions -----------------------------------------------------------------------------
    def _fire(self, entry: EntryT, event: E, step: Step) -> None:
        rule = self.TABLE.get((entry.state, event))
        if rule is None:
            self.counters[f"undefined:{entry.state.name}:{event.name}"] += 1
            if self.strict:
                raise ProtocolError(
                    f"{entry.transfer_id}: no transition for {event.name} in {entry.state.name}"
                )
            return
        if rule.reason is not None:
            step.reason = rule.reason
        before = entry.state
        if rule.next_state is not None and rule.next_state is not before:
            entry.state = rule.next_state
            entry.reason = entry.reason or step.reason  # the first reason given sticks
            if entry.state in self.TERMINAL:
                entry.deadline = None
                entry.ended_at = step.now
            elif entry.state is self.NEW:  # back to unknown: it held nothing, owes no verdict
                self._forget(entry.transfer_id, keep_attempt=True)
            step.actions.append(
                Transitioned(entry.transfer_id, before.name, entry.state.name, event.name,
                             step.now, step.reason)
            )
        for effect in rule.effects:
            self._run_effect(entry, effect, step)

    def _run_effect(self, entry: EntryT, effect: F, step: Step) -> None:
        raise NotImplementedError

    def _drop(self, what: str) -> None:
        self.counters[f"dropped:{what}"] += 1

    # -- the router's Withdraw (P's cores) --------------------------------------------------------
    def withdraw(self, attempt: TransferId, reason: str, now: float) -> list[Action]:
        """The router: no D takes its transfer ``attempt``. Fires WITHDRAWN on every transfer of it
        held now; one that begins later (KV computed after the Withdraw came) gets it as it begins
        (``_if_withdrawn``)."""
        step = Step(self._clock(now), reason=reason)
        self._withdrawn[attempt] = step.now
        for entry in list(self.entries.values()):
            if entry.transfer_id.router_attempt() == attempt:
                self._fire(entry, self.WITHDRAWN, step)
        return step.actions

    def _if_withdrawn(self, entry: EntryT, step: Step) -> None:
        if self._withdrawn and entry.transfer_id.router_attempt() in self._withdrawn:
            self._fire(entry, self.WITHDRAWN, step)

    # -- the peers D waits on (D's cores) ----------------------------------------------------------
    def _waits_on(self, entry: EntryT) -> tuple[PeerRank, ...]:
        """The peer ranks whose word this live transfer still waits for."""
        return ()

    def _watching(self) -> PeerWatch:
        """The peer watch, which only D's cores have."""
        if self.watch is None:
            raise ProtocolError(f"{type(self).__name__} watches no peer ranks")
        return self.watch

    def _watch_peers(self, step: Step) -> None:
        """Each tick: probe every peer rank a live transfer waits on; a transfer waiting on a rank
        that is gone recovers (SUSPECTED)."""
        wanted: set[PeerRank] = set()
        for entry in self.live():
            wanted.update(self._waits_on(entry))
        watch = self._watching()
        step.actions.extend(watch.tick(step.now, wanted))
        self._suspect(watch.gone(), step)

    def _suspect(self, suspected: dict[PeerRank, str], step: Step) -> None:
        if not suspected:
            return
        for entry in self.live():
            for peer in self._waits_on(entry):
                if peer in suspected:
                    self._fire(entry, self.SUSPECTED, Step(step.now, suspected[peer], actions=step.actions))
                    break

    def probe_answered(self, peer: str, rank: int, incarnation: str, now: float) -> list[Action]:
        """A peer rank answered our probe as process ``incarnation``."""
        step = Step(self._clock(now))
        self._suspect(self._watching().answered((peer, rank), incarnation, step.now), step)
        return step.actions

    def probe_failed(self, peer: str, rank: int, refused: bool, now: float) -> list[Action]:
        """A probe got no answer: ``refused`` (nothing listens there, or the connection was reset) or
        not (it timed out; silence is judged at the tick)."""
        step = Step(self._clock(now))
        self._suspect(self._watching().failed((peer, rank), refused, step.now), step)
        return step.actions

    # -- time passes -----------------------------------------------------------------------------
    def _tick(self, now: float) -> list[Action]:
        """Fire every lapsed deadline and forget tombstones older than ``tombstone_s``."""
        step = Step(self._clock(now))
        for entry in list(self.entries.values()):
            self._expire_if_due(entry, step)
            if entry.ended_at is not None and step.now - entry.ended_at >= self._tombstone_s:
                self._forget(entry.transfer_id)
        for attempt, told in list(self._withdrawn.items()):
            if step.now - told >= self._tombstone_s:
                del self._withdrawn[attempt]
        return step.actions

    def _forget(self, transfer_id: TransferId, keep_attempt: bool = False) -> None:
        """``keep_attempt``: still supersede older attempts of the lineage (the entry is forgotten
        long before a tombstone would be)."""
        del self.entries[transfer_id]
        attempts = self._attempts[transfer_id.lineage]
        attempts.discard(transfer_id)
        if not attempts and not keep_attempt:
            del self._attempts[transfer_id.lineage]
            self._latest_attempt.pop(transfer_id.lineage, None)

    # -- introspection ---------------------------------------------------------------------------
    def state_of(self, transfer_id: TransferId) -> S | None:
        entry = self.entries.get(transfer_id)
        return None if entry is None else entry.state

    def live(self) -> list[EntryT]:
        return [e for e in self.entries.values() if e.state not in self.TERMINAL]

    def has_live(self) -> bool:
        """Any transfer not yet ended: only then can a deadline come due (tombstones wait)."""
        return any(e.state not in self.TERMINAL for e in self.entries.values())
