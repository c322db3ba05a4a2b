"""D's view of the P ranks its live transfers wait on: probed every ``suspect_after_s / 3``, gone
when a probe is refused, when none has been answered for ``suspect_after_s``, or when the rank
answers as another process (restarted at the same address, it holds none of the old transfers).

Sans-I/O like the cores that own it (``consumer.py`` for push, ``reader.py`` for pull): time comes
in as an argument, probes go out as ``ProbePeer`` actions, answers come back as events. The owner
says which peer ranks it depends on at each tick; a rank no live transfer waits on is forgotten, so
a P that comes back later starts from a clean slate. Every transition is in ``TABLE``.

Why a probe and not the heartbeats: D's heartbeats renew P's lease and expect no answer, and a
SIGSTOPped or partitioned P accepts them into its kernel's buffers without a word. A probe's answer
comes from P's side-channel thread, so silence means P's process is not running (stopped, dead, cut
off), not that it is busy: a long prefill answers as fast as an idle one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .actions import ProbePeer
from .rules import Rule

PeerRank = tuple[str, int]  # (side-channel address, tensor-parallel rank)


class PState(enum.Enum):
    UNKNOWN = "unknown"  # watched; no answer yet
    ALIVE = "alive"      # answered within suspect_after_s, as the process it answered as first
    GONE = "gone"        # refused, silent or restarted: what waits on it recovers now


class PEvent(enum.Enum):
    ANSWERED = "answered"    # Alive, from the incarnation we know (or the first)
    RESTARTED = "restarted"  # Alive, from another incarnation
    REFUSED = "refused"      # nothing listens, or the connection was reset
    SILENT = "silent"        # no answer for suspect_after_s


class PEffect(enum.Enum):
    HEARD = "heard_at := now"
    SUSPECT = "the transfers waiting on this rank recover now"


S, E, F = PState, PEvent, PEffect
TABLE: dict[tuple[PState, PEvent], Rule[PState, PEffect]] = {
    (S.UNKNOWN, E.ANSWERED): Rule(S.ALIVE, (F.HEARD,)),
    (S.UNKNOWN, E.RESTARTED): Rule(S.ALIVE, (F.HEARD,)),  # unreachable: unknown has no incarnation yet
    (S.UNKNOWN, E.REFUSED): Rule(S.GONE, (F.SUSPECT,), "prefill unreachable: its side channel refused the connection"),
    (S.UNKNOWN, E.SILENT): Rule(S.GONE, (F.SUSPECT,), "prefill silent: no answer to a probe within suspect_after_s"),
    (S.ALIVE, E.ANSWERED): Rule(None, (F.HEARD,)),
    (S.ALIVE, E.RESTARTED): Rule(None, (F.HEARD, F.SUSPECT), "prefill restarted: a new process answers at its address"),
    (S.ALIVE, E.REFUSED): Rule(S.GONE, (F.SUSPECT,), "prefill unreachable: its side channel refused the connection"),
    (S.ALIVE, E.SILENT): Rule(S.GONE, (F.SUSPECT,), "prefill silent: no answer to a probe within suspect_after_s"),
    # Back (a pause ended, the network healed): what it holds now may be delivered; what already
    # recovered stays recovered.
    (S.GONE, E.ANSWERED): Rule(S.ALIVE, (F.HEARD,)),
    (S.GONE, E.RESTARTED): Rule(S.ALIVE, (F.HEARD,)),
    (S.GONE, E.REFUSED): Rule(None),
    (S.GONE, E.SILENT): Rule(None),
}


@dataclass
class _Peer:
    state: PState
    heard_at: float                       # the last answer, or when the watch began
    incarnation: str | None = None
    probing_since: float | None = None    # a probe is out
    next_probe_at: float = 0.0
    reason: str = ""                      # why it is GONE


class PeerWatch:
    """The peer ranks one core depends on. ``tick``, ``answered`` and ``failed`` return what they
    decided: probes to send, and the ranks now suspected (with why)."""

    def __init__(self, suspect_after_s: float):
        self.suspect_after_s = suspect_after_s
        self.probe_every_s = suspect_after_s / 3
        self._peers: dict[PeerRank, _Peer] = {}
        self._last_tick: float | None = None

    def state_of(self, peer: PeerRank) -> PState | None:
        record = self._peers.get(peer)
        return None if record is None else record.state

    def gone(self) -> dict[PeerRank, str]:
        """Every rank suspected now, with why: a transfer that starts waiting on one recovers too."""
        return {peer: r.reason for peer, r in self._peers.items() if r.state is PState.GONE}

    def tick(self, now: float, wanted: set[PeerRank]) -> list[ProbePeer]:
        """The probes to send now. ``wanted``: the ranks live transfers wait on; a rank silent for
        ``suspect_after_s`` is GONE after this (``gone``)."""
        for peer in set(self._peers) - wanted:
            del self._peers[peer]
        if self._last_tick is not None and now - self._last_tick > self.suspect_after_s / 2:
            # We did not run for a while (our own process stopped, or starved): no probe could be
            # sent or answered, so the silence is ours, not the peers'. Judge from now on.
            for watched in self._peers.values():
                watched.heard_at = max(watched.heard_at, now)
                if watched.probing_since is not None:
                    watched.probing_since = now
        self._last_tick = now
        probes: list[ProbePeer] = []
        for peer in sorted(wanted):
            record = self._peers.get(peer)
            if record is None:
                record = self._peers[peer] = _Peer(PState.UNKNOWN, now)
            if record.state is not PState.GONE and now - record.heard_at >= self.suspect_after_s:
                self._fire(peer, record, PEvent.SILENT, now)  # read back through gone()
            if record.probing_since is None and now >= record.next_probe_at:
                record.probing_since, record.next_probe_at = now, now + self.probe_every_s
                probes.append(ProbePeer(peer[0], peer[1]))
        return probes

    def answered(self, peer: PeerRank, incarnation: str, now: float) -> dict[PeerRank, str]:
        record = self._peers.get(peer)
        if record is None:  # no longer watched
            return {}
        record.probing_since = None
        restarted = record.incarnation is not None and incarnation != record.incarnation
        record.incarnation = incarnation
        return self._fire(peer, record, PEvent.RESTARTED if restarted else PEvent.ANSWERED, now)

    def failed(self, peer: PeerRank, refused: bool, now: float) -> dict[PeerRank, str]:
        """A probe got no answer: ``refused`` (nothing listens, reset), or it timed out (silence,
        which ``tick`` judges)."""
        record = self._peers.get(peer)
        if record is None:
            return {}
        record.probing_since = None
        return self._fire(peer, record, PEvent.REFUSED, now) if refused else {}

    def _fire(self, peer: PeerRank, record: _Peer, event: PEvent, now: float) -> dict[PeerRank, str]:
        """Applies the event's row; the rank, with why, if the row suspects it."""
        rule = TABLE[(record.state, event)]
        if rule.next_state is not None:
            record.state = rule.next_state
        suspected: dict[PeerRank, str] = {}
        for effect in rule.effects:
            if effect is F.HEARD:
                record.heard_at = now
            elif effect is F.SUSPECT:
                record.reason = f"{rule.reason} ({peer[0]} rank {peer[1]})"
                suspected[peer] = record.reason
        return suspected
