"""Pull mode's two cores, one lender (P lends its blocks) and one reader (D reads them), driven through
random interleavings, as test_protocol_stateful.py drives push's: offers, confirmations and
ReadFailed over a lossy, reordering, duplicating network with forged frames, clock jumps, and P's
clock skewed against D's. D's probes of P are answered, refused or left unanswered, and P may
restart: D then quarantines what it reads while the READ, which nothing can stop, may still land.
After every step:

- no READ outside a current loan: D posts a READ only of blocks P holds under a loan not yet ended;
- no P block freed (or reused) while a READ of it that D would still trust may be outstanding; a
  READ D gave up on may outlive P's lease (NIXL cannot cancel it), and then it is never trusted;
- no D block freed or reused under a READ;
- every transfer terminal within its bound, on both sides;
- blocks freed exactly once on each side, and both pools whole at the end;
- the bytes D hands to decode are exactly P's KV for those positions, including after prefix
  hits; nothing quarantined is ever handed to decode.

The last test breaks one lender row and shows the machine catches it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import (
    initialize, precondition, rule, run_state_machine_as_test,
)

from neuron_disagg.protocol import (
    AbortRead, FailTransfer, FinishLoad, FreeBlocks, LenderCore, LenderTimeouts, MessageError, PullOffer,
    RankRegions, ReadDone, ReadFailed, ReaderCore, ReaderTimeouts, RState, SendMessage, SubmitRead,
    TransferId, Transitioned, WireCodec,
)
from neuron_disagg.protocol import lender as lending
from neuron_disagg.protocol.actions import ProbePeer, Quarantine
from neuron_disagg.protocol.geometry import ModelShape, rank_regions, regions_bytes
from neuron_disagg.protocol.lender import LEffect, LEvent, LState
from neuron_disagg.protocol.rules import Rule
from neuron_disagg.transfer.memory import MemoryFabric

from .two_cores import POOL, TwoCoresOverALossyNetwork

SHAPE = ModelShape(num_layers=2, num_kv_heads=1, head_dim=8, dtype_bytes=1, block_tokens=1)
OFFER_S = 3.0  # P's offers expire this long after they are made (P's clock)
LT = LenderTimeouts(max_read_s=2, clock_skew_allowance_s=0.5, tombstone_s=40)
RT = ReaderTimeouts(max_read_s=2, clock_skew_allowance_s=0.5, tombstone_s=40, suspect_after_s=1.5)
L_BOUND = OFFER_S + LT.max_read_s + LT.clock_skew_allowance_s
R_BOUND = OFFER_S + RT.clock_skew_allowance_s + 2 * RT.max_read_s
SECRET = b"pull-stateful-test-secret-012345"
P_ADDR = "p:1"


class PullProtocol(TwoCoresOverALossyNetwork):
    P_BOUND, D_BOUND = L_BOUND, R_BOUND

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.codec = WireCodec(SECRET)
        self.forger = WireCodec(b"not-the-deployment-secret-000000")
        self.regions = rank_regions(SHAPE, POOL)
        self.fabric = MemoryFabric()
        self.fabric.register("p0", regions_bytes(self.regions))
        self.fabric.register("d0", regions_bytes(self.regions))
        self.p = LenderCore(0, 1, LT, strict=True)
        self.d = ReaderCore(0, 1, RT, strict=True)
        self.p_free, self.d_free = set(range(POOL)), set(range(POOL))
        self.p_held: dict[TransferId, tuple[int, ...]] = {}   # P blocks lent (or about to be) for a transfer
        self.d_owned: dict[TransferId, tuple[int, ...]] = {}  # D blocks allocated for a transfer's READ
        self.d_decoding: dict[TransferId, tuple[int, ...]] = {}
        self.prefix: dict[TransferId, tuple[int, ...]] = {}   # D blocks holding a prefix-cache hit
        self.to_p: list[bytes] = []
        self.to_d: list[bytes] = []  # offers, relayed by the router with the decode leg
        self.in_flight: dict[TransferId, SubmitRead] = {}
        self.trusted_until: dict[TransferId, float] = {}  # D's clock: a READ landing before this is used
        self.landed: set[TransferId] = set()
        self.p_source_reused: set[TransferId] = set()  # READs still out when P freed their source blocks
        self.prefilling: list[TransferId] = []
        self.offered_to_d: set[TransferId] = set()
        self.to_allocate: list[TransferId] = []
        self.withdrawn: set[TransferId] = set()
        self.length: dict[str, int] = {}
        self.attempts: dict[str, int] = {}
        self.next_request = 0
        self.forged = 0
        self.p_offset = 0.0  # P's clock minus D's (the harness's ``now`` is D's clock and true time)
        self.quarantined: set[TransferId] = set()

    # P ahead of D beyond the allowance is left out: D refuses such an offer only when it comes
    # promptly (test_a_late_offer_from_a_prefill_clock_far_ahead_is_read_after_its_lease_ended).
    @initialize(offset=st.sampled_from([-3.0, -0.4, 0.0, 0.4]))
    def clocks_disagree(self, offset):
        self.p_offset = offset

    # -- the harness performs what the cores ask ------------------------------------------------------
    def perform(self, side, actions):
        for action in actions:
            if isinstance(action, SubmitRead):
                self.check_read_is_of_a_current_loan(action)
                self.in_flight[action.transfer_id] = action
                self.trusted_until[action.transfer_id] = self.now + RT.max_read_s
            elif isinstance(action, AbortRead):
                self.in_flight.pop(action.transfer_id, None)
            elif isinstance(action, SendMessage):
                assert side == "d" and action.peer == P_ADDR, action
                self.to_p.append(self.codec.encode(action.message))
            elif isinstance(action, FreeBlocks):
                self.free(side, action)
            elif isinstance(action, FinishLoad):
                self.finish_load(action.transfer_id)
            elif isinstance(action, ProbePeer):
                assert (action.peer, action.rank) == (P_ADDR, 0), action
                self.probes.append(action)
            elif isinstance(action, Quarantine):
                tid = action.transfer_id
                assert tid in self.d_owned and tid not in self.quarantined, f"{tid} quarantined twice or unowned"
                self.quarantined.add(tid)
            elif isinstance(action, (FailTransfer, Transitioned)):
                pass
            else:
                raise AssertionError(f"unexpected action {action}")

    def check_read_is_of_a_current_loan(self, submit: SubmitRead):
        tid = submit.transfer_id
        loan = self.p.entries.get(tid)
        assert loan is not None and loan.state is LState.HELD, (
            f"READ of {tid} outside a current loan: P's is {loan and loan.state.name} ({loan and loan.reason})")
        assert tid in self.p_held and self.p_held[tid] == loan.block_ids, f"READ of {tid}: P no longer holds its blocks"
        assert self.now < loan.offer.expires_at, f"READ of {tid} posted after its offer expired (D's clock)"

    def read_still_trusted(self, tid) -> bool:
        return (tid in self.in_flight and self.d.state_of(tid) is RState.READING
                and self.now < self.trusted_until[tid])

    def free(self, side, action: FreeBlocks):
        tid, blocks = action.transfer_id, tuple(action.block_ids)
        if side == "p":
            assert not self.read_still_trusted(tid), f"P freed {tid}'s blocks under a READ D still trusts"
            if tid in self.in_flight:
                self.p_source_reused.add(tid)
            assert self.p_held.pop(tid, None) == blocks, f"P freed {blocks} of {tid} not held (twice?)"
            assert not self.p_free & set(blocks)
            self.p_free |= set(blocks)
        else:
            assert tid not in self.in_flight, f"D freed {tid}'s blocks under an in-flight READ"
            assert self.d_owned.pop(tid, None) == blocks, f"D freed {blocks} of {tid} not owned (twice?)"
            self.d_free |= set(blocks) | set(self.prefix.pop(tid, ()))

    def finish_load(self, tid):
        assert tid not in self.quarantined, f"quarantined {tid} handed to decode"
        assert tid in self.landed, f"{tid} handed to decode before its READ landed"
        assert tid not in self.p_source_reused, f"{tid} handed to decode though P freed its source mid-READ"
        blocks = self.prefix.pop(tid, ()) + self.d_owned.pop(tid)
        for pos, block in enumerate(blocks):
            assert self._block("d0", block) == self.pattern(tid.request, pos), f"{tid} position {pos} corrupt"
        self.d_decoding[tid] = blocks

    # -- memory contents ---------------------------------------------------------------------------------
    def pattern(self, request: str, pos: int) -> bytes:
        rng = np.random.default_rng([int(request[1:]), pos])
        return rng.integers(0, 256, size=len(self.regions) * self.regions[0].block_bytes, dtype=np.uint8).tobytes()

    def _block(self, agent, block, data=None):
        mem, out = self.fabric.memory[agent], []
        for i, region in enumerate(self.regions):
            n = region.block_bytes
            start = region.base_addr + block * region.block_stride_bytes
            if data is None:
                out.append(bytes(mem[start:start + n]))
            else:
                mem[start:start + n] = data[i * n:(i + 1) * n]
        return b"".join(out)

    def execute_read(self, submit: SubmitRead):
        """A READ: P's bytes as they are now, into D's blocks (a READ of blocks P reused reads the new
        request's bytes, as the hardware would)."""
        dst = memoryview(self.fabric.memory["d0"])
        for plan in submit.plans.values():
            for write in plan.writes:
                src = memoryview(self.fabric.memory[write.remote_agent])
                for s, d, n in zip(write.src_addr.tolist(), write.dst_addr.tolist(), write.length.tolist(), strict=True):
                    dst[d:d + n] = src[s:s + n]

    # -- the router and the two engines --------------------------------------------------------------------
    @rule(length=st.integers(1, 4), retry=st.booleans())
    def request_arrives(self, length, retry):
        """The router sends the prefill leg; with ``retry`` it re-sends an earlier request."""
        if retry and self.length:
            request = sorted(self.length)[self.next_request % len(self.length)]
            attempt = self.attempts[request] = self.attempts[request] + 1
        else:
            request, attempt = f"r{self.next_request}", 0
            self.length[request], self.attempts[request] = length, 0
        self.next_request += 1
        self.prefilling.append(TransferId(request, attempt))

    @precondition(lambda self: self.prefilling)
    @rule(i=st.integers(0, 100))
    def prefill_finishes(self, i):
        """P lends the blocks its prefill filled; the router relays the offer with the decode leg,
        unless it has retried the request since (it never sends D an attempt it abandoned)."""
        tid = self.prefilling.pop(i % len(self.prefilling))
        blocks = self.take(self.p_free, self.length[tid.request])
        if blocks is None:
            return  # out of blocks: the prefill fails before anything is lent
        for pos, block in enumerate(blocks):
            self._block("p0", block, self.pattern(tid.request, pos))
        self.p_held[tid] = blocks
        offer = PullOffer(tid, "p", P_ADDR, 1, (RankRegions(0, "p0", self.regions),), blocks,
                          self.p_now + OFFER_S, self.p_now)
        self.perform("p", self.p.offer(offer, self.p_now))
        if tid not in self.withdrawn and tid.attempt == self.attempts[tid.request]:
            self.to_d.append(self.codec.encode(offer))

    @precondition(lambda self: self.to_allocate)
    @rule(i=st.integers(0, 100), hit=st.integers(0, 4))
    def decode_allocates(self, i, hit):
        tid = self.to_allocate.pop(i % len(self.to_allocate))
        n = self.length[tid.request]
        hit = min(hit, n - 1)  # D already holds the first ``hit`` positions (prefix cache)
        blocks = self.take(self.d_free, n)
        if blocks is None:
            self.perform("d", self.d.abort(tid, "decode out of blocks", self.now))
            return
        prefix, fresh = blocks[:hit], blocks[hit:]
        for pos, block in enumerate(prefix):
            self._block("d0", block, self.pattern(tid.request, pos))
        for block in fresh:  # stale garbage from whoever used the block before
            self._block("d0", block, bytes(len(self.regions) * self.regions[0].block_bytes))
        self.prefix[tid], self.d_owned[tid] = prefix, fresh
        self.perform("d", self.d.allocated(tid, RankRegions(0, "d0", self.regions), fresh, hit, self.now))

    @precondition(lambda self: self.d.live())
    @rule(i=st.integers(0, 100))
    def decode_aborts(self, i):
        live = self.d.live()
        self.perform("d", self.d.abort(live[i % len(live)].transfer_id, "client disconnected", self.now))

    @precondition(lambda self: self.p.live())
    @rule(i=st.integers(0, 100))
    def prefill_aborts(self, i):
        live = self.p.live()
        self.perform("p", self.p.abort(live[i % len(live)].transfer_id, "engine shutdown", self.p_now))

    @precondition(lambda self: self.length)
    @rule(i=st.integers(0, 100))
    def router_withdraws(self, i):
        """The router tells P no D takes an attempt; it does so only when no D got its decode leg,
        so from here the router relays none of its offers."""
        request = sorted(self.length)[i % len(self.length)]
        tid = TransferId(request, self.attempts[request])
        if tid in self.offered_to_d:
            return
        self.withdrawn.add(tid)
        self.to_d = [f for f in self.to_d if self.codec.decode(f).transfer_id != tid]
        self.perform("p", self.p.withdraw(tid, "decode refused it", self.p_now))

    @precondition(lambda self: self.d_decoding)
    @rule()
    def decode_finishes(self):
        tid = sorted(self.d_decoding, key=str)[0]
        self.d_free |= set(self.d_decoding.pop(tid))

    # -- the fabric ---------------------------------------------------------------------------------
    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(0, 100))
    def read_lands(self, i):
        """The READ ends: its bytes are in D's blocks, and its ReadDone reaches P with it."""
        tid = sorted(self.in_flight, key=str)[i % len(self.in_flight)]
        submit = self.in_flight.pop(tid)
        assert self.d_owned.get(tid) is not None, f"{tid} read into blocks D no longer holds for it"
        self.execute_read(submit)
        self.landed.add(tid)
        self.to_p.append(self.codec.encode(submit.notification))
        self.perform("d", self.d.read_done(tid, self.now))

    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(0, 100))
    def read_fails(self, i):
        tid = sorted(self.in_flight, key=str)[i % len(self.in_flight)]
        del self.in_flight[tid]
        self.perform("d", self.d.read_failed(tid, "remote disconnected", self.now))

    # -- the network (its rule: two_cores.py) ---------------------------------------------------------
    def deliver(self, to_p, frame):
        message = self.codec.decode(frame)
        if to_p:
            self.perform("p", self.p.confirmed(message, self.p_now))
            return
        tid = message.transfer_id
        self.perform("d", self.d.offered(message, self.now))
        if tid not in self.offered_to_d and self.d.state_of(tid) is RState.WAITING:
            self.to_allocate.append(tid)  # D's scheduler allocates once for the request
        self.offered_to_d.add(tid)

    @rule(to_p=st.booleans(), request=st.integers(0, 5), kind=st.sampled_from(["offer", "done", "failed"]))
    def forged_message(self, to_p, request, kind):
        tid = TransferId(f"r{request}", 0)
        message = {"done": ReadDone(tid, 0, 1), "failed": ReadFailed(tid, 0, 1, "forged"),
                   "offer": PullOffer(tid, "evil", "evil:1", 1, (RankRegions(0, "p0", self.regions),), (0,), 1e12)}[kind]
        try:
            self.codec.decode(self.forger.encode(message))
        except MessageError:
            self.forged += 1
        else:
            raise AssertionError("a message signed with another secret was accepted")

    @rule(request=st.integers(50, 60), done=st.booleans())
    def confirmation_for_unknown_transfer(self, request, done):
        tid = TransferId(f"r{request}", 0)
        self.deliver(True, self.codec.encode(ReadDone(tid, 0, 1) if done else ReadFailed(tid, 0, 1, "late")))

    # -- the end (time passing, the network and the invariants both modes share: two_cores.py) -----
    def teardown(self):
        """Let time run out: every transfer must end and every block come home."""
        for _ in range(4):
            while self.to_p or self.to_d:
                queue = self.to_p or self.to_d
                self.deliver(queue is self.to_p, queue.pop(0))
            while self.to_allocate:
                self.decode_allocates(0, 0)
            self.time_passes(L_BOUND + R_BOUND + 1)
            for tid in list(self.d_decoding):
                self.d_free |= set(self.d_decoding.pop(tid))
            for probe in self.probes:
                self.perform("d", self.d.probe_answered(probe.peer, probe.rank, f"p{self.p_incarnation}", self.now))
            self.probes.clear()
        assert not self.p.live() and not self.d.live()
        assert not self.in_flight
        assert self.p_free == set(range(POOL)), "P blocks leaked"
        assert self.d_free == set(range(POOL)), "D blocks leaked"


SETTINGS = settings(max_examples=int(os.environ.get("STATEFUL_EXAMPLES", "150")), stateful_step_count=60,
                    deadline=None, suppress_health_check=[HealthCheck.too_slow])
PullProtocol.TestCase.settings = SETTINGS
TestPullProtocol = pytest.mark.slow(PullProtocol.TestCase)  # 150 random runs of 60 steps


def test_the_pull_state_machine_test_catches_a_lender_that_frees_blocks_under_a_read(monkeypatch):
    # The lender must hold its loan through an abort (a reader may be mid-READ: the lease decides);
    # one that frees on the abort lets P reuse blocks a READ D trusts is still reading.
    monkeypatch.setitem(lending.TABLE, (LState.HELD, LEvent.ABORT), Rule(LState.RELEASED, (LEffect.FREE_BLOCKS,)))
    # Either check may see it first: a READ posted after the abort freed the loan, or a loan freed
    # under a READ already posted. Generation only: shrinking the example would take most of a minute.
    with pytest.raises(AssertionError, match="outside a current loan|under a READ D still trusts"):
        run_state_machine_as_test(PullProtocol, settings=settings(
            SETTINGS, max_examples=200, derandomize=True, database=None, phases=[Phase.generate]))


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="known gap: D tells skew from delay only by sent_at, so an offer from a P whose clock "
                   "is ahead beyond the allowance passes D's check once it is late by the excess, and D may "
                   "then READ after P's lease freed the blocks")
def test_a_late_offer_from_a_prefill_clock_far_ahead_is_read_after_its_lease_ended():
    m = PullProtocol()
    m.clocks_disagree(3.0)  # P's clock 3 s ahead, the allowance 0.5 s
    m.request_arrives(1, False)
    m.prefill_finishes(0)
    m.time_passes(2.6)  # the offer reaches D 2.6 s late: sent_at is only 0.4 s in D's future
    m.network(0, False, "deliver")
    m.time_passes(2.9)  # P's lease (its expiry + 2.5 s, on P's clock) has ended; D's clock says the offer has not
    assert m.p.state_of(TransferId("r0")) is LState.EXPIRED
    m.decode_allocates(0, 0)  # the harness's check: a READ outside a current loan
