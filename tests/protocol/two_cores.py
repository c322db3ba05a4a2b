"""What the push and pull state-machine tests share: two protocol cores (P's and D's) over a lossy,
reordering, duplicating network, P's clock offset from D's, D's probes of P, time passing, and the invariants that
hold for either mode. Each test supplies its cores, its ``perform`` and ``deliver``, its bounds and
the pools' bookkeeping (``p_held``/``p_free``, ``d_owned``/``d_decoding``/``prefix``/``d_free``)."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

POOL = 24  # blocks in each side's pool


class TwoCoresOverALossyNetwork(RuleBasedStateMachine):
    P_BOUND: float  # how long any P-side transfer may live, from its creation
    D_BOUND: float  # the same for D

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0     # D's clock, and true time
        self.p_offset = 0.0  # P's clock minus D's
        self.to_p: list[bytes] = []
        self.to_d: list[bytes] = []
        self.probes: list = []       # D's probes of P (ProbePeer), not answered yet
        self.p_incarnation = 0       # which process answers at P's address
        self.p_engine: dict = {}     # P blocks the engine holds for a prefill still running (no transfer's)

    @property
    def p_now(self) -> float:
        return self.now + self.p_offset

    def perform(self, side: str, actions: list) -> None:
        raise NotImplementedError

    def deliver(self, to_p: bool, frame: bytes) -> None:
        raise NotImplementedError

    def take(self, pool: set[int], n: int) -> tuple[int, ...] | None:
        blocks = tuple(sorted(pool)[:n]) if n <= len(pool) else None
        if blocks:
            pool.difference_update(blocks)
        return blocks

    # -- the network ---------------------------------------------------------------------------------
    @precondition(lambda self: self.to_p or self.to_d)
    @rule(i=st.integers(0, 100), to_p=st.booleans(), fate=st.sampled_from(["deliver"] * 4 + ["dup", "drop"]))
    def network(self, i, to_p, fate):
        queue = self.to_p if (to_p and self.to_p) or not self.to_d else self.to_d
        frame = queue[i % len(queue)]
        if fate != "dup":
            queue.remove(frame)
        if fate != "drop":
            self.deliver(queue is self.to_p, frame)

    # -- D's probes of P ---------------------------------------------------------------------------------
    @precondition(lambda self: self.probes)
    @rule(i=st.integers(0, 100), fate=st.sampled_from(["alive"] * 3 + ["refused", "unanswered", "unanswered"]))
    def probe_ends(self, i, fate):
        """P answers (as the process it is now), refuses, or times out: stopped, dead or cut off."""
        probe = self.probes.pop(i % len(self.probes))
        if fate == "alive":
            self.perform("d", self.d.probe_answered(probe.peer, probe.rank, f"p{self.p_incarnation}", self.now))
        else:
            self.perform("d", self.d.probe_failed(probe.peer, probe.rank, fate == "refused", self.now))

    @rule()
    def prefill_restarts(self):
        """Another process answers at P's address from now on. The old one is not really gone here:
        what it wrote or lent may still land, which is what D's quarantine must hold."""
        self.p_incarnation += 1

    # -- time -------------------------------------------------------------------------------------------
    @rule(dt=st.sampled_from([0.1, 0.4, 1.0, 2.5, 7.0, 30.0]))
    def time_passes(self, dt):
        self.now += dt
        self.perform("p", self.p.tick(self.p_now))
        self.perform("d", self.d.tick(self.now))

    @rule(steps=st.integers(2, 12))
    def time_passes_tick_by_tick(self, steps):
        """Time passing as the threads see it, a tick every 0.25 s: long enough at a stretch for D to
        judge a P that answers no probe silent (longer gaps look like D's own pause to it)."""
        for _ in range(steps):
            self.time_passes(0.25)

    # -- invariants for either mode ---------------------------------------------------------------------
    @invariant()
    def pools_are_conserved(self):
        held = [b for group in (self.p_held, self.p_engine) for blocks in group.values() for b in blocks]
        assert len(held) == len(set(held)) and not set(held) & self.p_free
        assert len(held) + len(self.p_free) == POOL
        used = [b for group in (self.d_owned, self.d_decoding, self.prefix) for blocks in group.values() for b in blocks]
        assert len(used) == len(set(used)) and not set(used) & self.d_free
        assert len(used) + len(self.d_free) == POOL

    @invariant()
    def every_transfer_ends_within_its_bound(self):
        for side, core, bound, now in (("P", self.p, self.P_BOUND, self.p_now), ("D", self.d, self.D_BOUND, self.now)):
            for entry in core.live():
                assert now < entry.created_at + bound, (
                    f"I3: {side} {entry.transfer_id} still {entry.state.name} at {now}, "
                    f"created {entry.created_at}, bound {bound}")

    @invariant()
    def nothing_undefined_happened(self):
        assert not [k for k in list(self.p.counters) + list(self.d.counters) if k.startswith("undefined")]
