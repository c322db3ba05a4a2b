"""One P core and one D core driven through random interleavings over a lossy, reordering,
duplicating network with forged messages, clock jumps and P's clock skewed against D's (inside the
allowance and far beyond it, either way). D's probes of P are answered, refused or left unanswered
at random, and P may restart: D then quarantines what it registered while P, which in this model
never really dies, may still write into it. After every step: I1 (writes only for
current registrations), I2 (no D block freed or reused under a write, quarantined or not), I3
(every transfer terminal within its bound), I4 (blocks freed exactly once; pools whole at the end),
I7 in miniature (the bytes D hands to decode are exactly P's KV for those positions, including
after prefix hits; nothing quarantined is ever handed to decode).

P streams: while a prefill runs, its finished blocks are written as chunks, one write in flight per
transfer, and the engine may preempt the prefill and hand its blocks to another request at once,
under a chunk write that then carries someone else's bytes: what D decodes must still be exactly
P's KV, so the stream is written again after the recompute, and never overtaken."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test

from neuron_disagg.protocol import (
    AbortWrite, Cancel, ConsumerCore, ConsumerTimeouts, DState, FailTransfer, FinishLoad, FreeBlocks,
    Heartbeat, MessageError, ProducerCore, ProducerTimeouts, RankRegions, Registration,
    SendMessage, SubmitWrite, TransferId, Transitioned, WireCodec, WriteDone, WriteFailed,
)
from neuron_disagg.protocol import consumer, producer
from neuron_disagg.protocol.actions import ProbePeer, Quarantine
from neuron_disagg.protocol.consumer import DEffect, DEvent
from neuron_disagg.protocol.rules import Rule
from neuron_disagg.protocol.geometry import ModelShape, rank_regions, regions_bytes
from neuron_disagg.transfer.memory import MemoryFabric

from .two_cores import POOL, TwoCoresOverALossyNetwork

SHAPE = ModelShape(num_layers=2, num_kv_heads=1, head_dim=8, dtype_bytes=1, block_tokens=1)
PT = ProducerTimeouts(lease_s=3, max_write_s=2, watchdog_s=5, clock_skew_allowance_s=0.5, tombstone_s=40)
DT = ConsumerTimeouts(watchdog_s=5, admission_timeout_s=4, heartbeat_interval_s=1, max_write_s=2,
                      clock_skew_allowance_s=0.5, tombstone_s=40, suspect_after_s=1.5)
D_BOUND = DT.admission_timeout_s + DT.watchdog_s + 2 * DT.max_write_s + DT.clock_skew_allowance_s
P_BOUND = 2 * PT.lease_s + DT.admission_timeout_s + DT.watchdog_s + 2 * PT.max_write_s + PT.clock_skew_allowance_s
SECRET = b"stateful-test-secret-0123456789!"
D_ADDR, P_ADDR = "d:1", "p:1"


class PushProtocol(TwoCoresOverALossyNetwork):
    P_BOUND, D_BOUND = P_BOUND, D_BOUND

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.codec = WireCodec(SECRET)
        self.forger = WireCodec(b"not-the-deployment-secret-000000")
        self.regions = rank_regions(SHAPE, POOL)
        self.fabric = MemoryFabric()
        self.fabric.register("p", regions_bytes(self.regions))
        self.fabric.register("d0", regions_bytes(self.regions))
        self.p = ProducerCore(self.regions, timeouts=PT, strict=True)
        self.d = ConsumerCore(D_ADDR, timeouts=DT, strict=True)
        self.p_free, self.d_free = set(range(POOL)), set(range(POOL))
        self.p_held: dict[TransferId, tuple[int, ...]] = {}   # P blocks owned by a transfer
        self.d_owned: dict[TransferId, tuple[int, ...]] = {}  # D blocks registered for a transfer
        self.d_decoding: dict[TransferId, tuple[int, ...]] = {}
        self.prefix: dict[TransferId, tuple[int, ...]] = {}   # D blocks holding a prefix-cache hit
        self.to_p: list[bytes] = []
        self.to_d: list[bytes] = []
        self.in_flight: dict[TransferId, SubmitWrite] = {}
        self.landed: set[TransferId] = set()
        self.prefilling: list[TransferId] = []
        self.pending_on_d: list[TransferId] = []
        self.length: dict[str, int] = {}
        self.attempts: dict[str, int] = {}
        self.next_request = 0
        self.p_heard_cancel: set[TransferId] = set()
        self.p_latest_attempt: dict[str, int] = {}
        self.forged = 0
        self.p_offset = 0.0  # P's clock minus D's (the harness's ``now`` is D's clock and true time)
        self.quarantined: set[TransferId] = set()  # D's request went on without these transfers' blocks
        self.reached_p: set[bytes] = set()  # frames P has received (a duplicated one stays queued too)
        self.p_computed: dict[TransferId, int] = {}  # a running prefill's finished blocks

    @initialize(offset=st.sampled_from([-3.0, -0.4, 0.0, 0.4, 3.0]))
    def clocks_disagree(self, offset):
        self.p_offset = offset

    # -- the harness performs what the cores ask ----------------------------------------------------
    def perform(self, side, actions):
        for action in actions:
            if isinstance(action, SubmitWrite):
                self.check_write_is_current(action)
                assert action.transfer_id not in self.in_flight, f"{action.transfer_id}: a second write in flight"
                self.in_flight[action.transfer_id] = action
            elif isinstance(action, AbortWrite):
                self.in_flight.pop(action.transfer_id, None)
            elif isinstance(action, SendMessage):
                (self.to_d if side == "p" else self.to_p).append(self.codec.encode(action.message))
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

    def check_write_is_current(self, submit: SubmitWrite):
        tid = submit.transfer_id
        reg = self.p.entries[tid].registration
        assert tid not in self.p_heard_cancel, f"I1: write for {tid} after P heard its Cancel"
        assert self.p_now < reg.expires_at, f"I1: write for {tid} on a registration expired by P's clock"
        assert tid.attempt >= self.p_latest_attempt.get(tid.request, 0), f"I1: superseded {tid} written"

    def free(self, side, action: FreeBlocks):
        tid, blocks = action.transfer_id, tuple(action.block_ids)
        if side == "p":
            assert self.p_held.pop(tid, None) == blocks, f"I4: P freed {blocks} of {tid} not held"
            assert not self.p_free & set(blocks)
            self.p_free |= set(blocks)
        else:
            assert tid not in self.in_flight, f"I2: D freed {tid}'s blocks under an in-flight write"
            assert self.d_owned.pop(tid, None) == blocks, f"I4: D freed {blocks} of {tid} not owned"
            self.d_free |= set(blocks) | set(self.prefix.pop(tid, ()))

    def finish_load(self, tid):
        assert tid not in self.quarantined, f"I7: quarantined {tid} handed to decode"
        assert tid in self.landed, f"I7: {tid} handed to decode before its write landed"
        blocks = self.prefix.pop(tid, ()) + self.d_owned.pop(tid)
        for pos, block in enumerate(blocks):
            assert self.d_block(block) == self.pattern(tid.request, pos), f"I7: {tid} position {pos} corrupt"
        self.d_decoding[tid] = blocks

    # -- memory contents ---------------------------------------------------------------------------
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

    def d_block(self, block):
        return self._block("d0", block)

    # -- the router and the two engines -----------------------------------------------------------------
    @rule(length=st.integers(1, 4), retry=st.booleans())
    def request_arrives(self, length, retry):
        """The router sends both legs at once; with ``retry`` it re-sends an earlier request."""
        if retry and self.length:
            request = sorted(self.length)[self.next_request % len(self.length)]
            attempt = self.attempts[request] = self.attempts[request] + 1
        else:
            request, attempt = f"r{self.next_request}", 0
            self.length[request], self.attempts[request] = length, 0
        self.next_request += 1
        tid = TransferId(request, attempt)
        self.prefilling.append(tid)
        self.pending_on_d.append(tid)
        self.perform("d", self.d.expect(tid, P_ADDR, 1, self.now))

    @precondition(lambda self: self.prefilling)
    @rule(i=st.integers(0, 100), announced=st.sampled_from(["not", "as computed", "other blocks"]))
    def prefill_finishes(self, i, announced):
        """``announced``: whether the engine told P's writer the blocks before the last forward
        (kv_coming), and whether they are those the forward used: a plan made for other blocks
        must never be written."""
        tid = self.prefilling.pop(i % len(self.prefilling))
        blocks = self.p_engine.pop(tid, None) or self.take(self.p_free, self.length[tid.request])
        self.p_computed.pop(tid, None)
        if blocks is None:
            self.perform("p", self.p.abort(tid, "prefill out of blocks", self.p_now))
            return
        if announced != "not":
            self.p.kv_coming(tid, blocks if announced == "as computed" else tuple(b + 1 for b in blocks))
        for pos, block in enumerate(blocks):
            self._block("p", block, self.pattern(tid.request, pos))
        self.p_held[tid] = blocks
        self.perform("p", self.p.kv_ready(tid, blocks, self.p_now))

    @precondition(lambda self: self.prefilling)
    @rule(i=st.integers(0, 100), steps=st.integers(1, 3))
    def prefill_step_ends(self, i, steps):
        """A step of a chunked prefill ends: ``steps`` more blocks are final (never the last one,
        which only the prefill's end completes), and the writer hears of every finished block."""
        tid = self.prefilling[i % len(self.prefilling)]
        n = self.length[tid.request]
        if n < 2:
            return
        if tid not in self.p_engine:
            blocks = self.take(self.p_free, n)
            if blocks is None:
                return
            self.p_engine[tid], self.p_computed[tid] = blocks, 0
        blocks = self.p_engine[tid]
        done = self.p_computed[tid] = min(n - 1, self.p_computed[tid] + steps)
        for pos in range(done):
            self._block("p", blocks[pos], self.pattern(tid.request, pos))
        self.perform("p", self.p.chunk_ready(tid, blocks[:done], self.p_now))

    @rule(length=st.integers(2, 4), hit=st.integers(0, 2), steps=st.integers(1, 3))
    def request_streams(self, length, hit, steps):
        """The common shape, made common here too: D registers at once, its registration reaches P
        before P's first step ends, and that step's blocks go out while the prefill runs on."""
        self.request_arrives(length, False)
        tid = self.prefilling[-1]
        self.pending_on_d.remove(tid)
        self.pending_on_d.append(tid)
        self.decode_allocates(len(self.pending_on_d) - 1, hit)
        for frame in [f for f in self.to_p if isinstance(self.codec.decode(f), Registration)]:
            self.to_p.remove(frame)
            self.deliver(True, frame)
        self.prefill_step_ends(len(self.prefilling) - 1, steps)

    @precondition(lambda self: self.p_engine)
    @rule(i=st.integers(0, 100))
    def prefill_is_preempted(self, i):
        """The engine preempts a running prefill: its blocks go back to the pool and to another
        request at once (here: overwritten), maybe under a chunk write; it is computed again later."""
        tid = sorted(self.p_engine, key=str)[i % len(self.p_engine)]
        self.release_engine_blocks(tid)
        self.perform("p", self.p.preempted(tid, self.p_now))

    @precondition(lambda self: self.prefilling)
    @rule(i=st.integers(0, 100))
    def prefill_request_ends_early(self, i):
        """The prefill request is aborted while it runs (the client left): its blocks go back at once."""
        tid = self.prefilling.pop(i % len(self.prefilling))
        self.release_engine_blocks(tid)
        self.perform("p", self.p.abort(tid, "client disconnected", self.p_now))

    def release_engine_blocks(self, tid):
        for block in self.p_engine.pop(tid, ()):
            self._block("p", block, bytes([0xEE]) * (len(self.regions) * self.regions[0].block_bytes))
            self.p_free.add(block)
        self.p_computed.pop(tid, None)

    @precondition(lambda self: self.pending_on_d)
    @rule(i=st.integers(0, 100), hit=st.integers(0, 4))
    def decode_allocates(self, i, hit):
        tid = self.pending_on_d.pop(i % len(self.pending_on_d))
        if self.d.state_of(tid) is not DState.PENDING:
            return
        n = self.length[tid.request]
        hit = min(hit, n - 1)  # D already holds the first ``hit`` positions (prefix cache)
        blocks = self.take(self.d_free, n)
        if blocks is None:
            return
        prefix, fresh = blocks[:hit], blocks[hit:]
        for pos, block in enumerate(prefix):
            self._block("d0", block, self.pattern(tid.request, pos))
        for block in fresh:  # stale garbage from whoever used the block before
            self._block("d0", block, bytes(len(self.regions) * self.regions[0].block_bytes))
        self.prefix[tid], self.d_owned[tid] = prefix, fresh
        reg = Registration(tid, "d", f"d-{tid}", D_ADDR, 1, (RankRegions(0, "d0", self.regions),),
                           fresh, hit, 0.0)
        self.perform("d", self.d.allocated(reg, self.now))

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
        """The router tells P no D takes an attempt. It does so only when D never got the request;
        here it may come at any time, and P must still stay safe and lose nothing."""
        request = sorted(self.length)[i % len(self.length)]
        self.perform("p", self.p.withdraw(TransferId(request, self.attempts[request]), "decode refused it",
                                          self.p_now))

    @precondition(lambda self: self.d_decoding)
    @rule()
    def decode_finishes(self):
        tid = sorted(self.d_decoding, key=str)[0]
        self.d_free |= set(self.d_decoding.pop(tid))

    # -- the fabric --------------------------------------------------------------------------------
    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(0, 100))
    def write_lands(self, i):
        tid = sorted(self.in_flight, key=str)[i % len(self.in_flight)]
        submit = self.in_flight.pop(tid)
        if submit.plan.writes:  # I2: every destination block is still this transfer's
            owned = self.d_owned.get(tid)
            assert owned is not None, f"I2: {tid} wrote into blocks D no longer holds for it"
        self.fabric.execute("p", submit.plan)
        if submit.notification is not None:  # the last write: D hears of it; chunks are silent
            self.landed.add(tid)
            self.to_d.append(self.codec.encode(submit.notification))
        self.perform("p", self.p.write_done(tid, self.p_now))

    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(0, 100))
    def write_fails(self, i):
        tid = sorted(self.in_flight, key=str)[i % len(self.in_flight)]
        del self.in_flight[tid]
        self.perform("p", self.p.write_failed(tid, "remote disconnected", self.p_now))

    # -- P resumes (D's probes of P: two_cores.py) ------------------------------------------------------
    @rule()
    def prefill_resumes_and_catches_up(self):
        """A P that was stopped (and so answered no probe) resumes: its writer, ahead of its side
        channel, finishes its prefills and writes for the registrations it had before it reads D's
        Cancels, so the writes land in blocks D has quarantined meanwhile."""
        cancels = [f for f in self.to_p if isinstance(self.codec.decode(f), Cancel)]
        while len(self.to_p) > len(cancels):
            frame = next(f for f in self.to_p if f not in cancels)
            self.to_p.remove(frame)
            self.deliver(True, frame)
        while self.prefilling:
            self.prefill_finishes(0, "not")
        while self.in_flight:
            self.write_lands(0)

    # -- the network (its rule: two_cores.py) ---------------------------------------------------------
    def deliver(self, to_p, frame):
        message = self.codec.decode(frame)
        if to_p:
            self.reached_p.add(frame)
            if isinstance(message, Cancel):
                self.p_heard_cancel.add(message.transfer_id)
            tid = message.transfer_id
            if isinstance(message, Registration):
                self.p_latest_attempt[tid.request] = max(self.p_latest_attempt.get(tid.request, 0), tid.attempt)
                self.perform("p", self.p.registration_received(message, self.p_now))
            elif isinstance(message, Heartbeat):
                self.perform("p", self.p.heartbeat(message, self.p_now))
            else:
                self.perform("p", self.p.cancel(message, self.p_now))
        else:
            self.perform("d", self.d.verdict(message, self.now))

    @precondition(lambda self: any(isinstance(self.codec.decode(f), Registration) for f in self.to_p))
    @rule(i=st.integers(0, 100))
    def registration_send_fails(self, i):
        """D's send of a registration failed (P's side channel refused it): P never got it, and D hears so."""
        frames = [f for f in self.to_p if isinstance(self.codec.decode(f), Registration) and f not in self.reached_p]
        if not frames:
            return
        frame = frames[i % len(frames)]
        self.to_p.remove(frame)
        tid = self.codec.decode(frame).transfer_id
        self.perform("d", self.d.undelivered(tid, 0, "ConnectionRefusedError", self.now))

    @rule(to_p=st.booleans(), request=st.integers(0, 5), kind=st.sampled_from(["cancel", "done", "failed", "registration"]))
    def forged_message(self, to_p, request, kind):
        tid = TransferId(f"r{request}", 0)
        message = {"cancel": Cancel(tid, D_ADDR, 1, "forged"), "done": WriteDone(tid, 0, 1),
                   "failed": WriteFailed(tid, 0, 1, "forged"),
                   "registration": Registration(tid, "evil", "x", "evil:1", 1,
                                                (RankRegions(0, "d0", self.regions),), (0,), 0, 1e12)}[kind]
        try:
            self.codec.decode(self.forger.encode(message))
        except MessageError:
            self.forged += 1
        else:
            raise AssertionError("a message signed with another secret was accepted")

    @rule(to_p=st.booleans(), request=st.integers(50, 60))
    def message_for_unknown_transfer(self, to_p, request):
        tid = TransferId(f"r{request}", 0)
        frame = self.codec.encode(Heartbeat(tid, self.now) if to_p else WriteDone(tid, 0, 1))
        self.deliver(to_p, frame)

    # -- the end (time passing, the network and the invariants both modes share: two_cores.py) -----
    def teardown(self):
        """Let time run out: every transfer must end and every block come home."""
        while self.prefilling:
            self.prefill_request_ends_early(0)
        for _ in range(4):
            while self.to_p or self.to_d:
                queue = self.to_p or self.to_d
                self.deliver(queue is self.to_p, queue.pop(0))
            self.time_passes(P_BOUND + 1)
            for tid in list(self.d_decoding):
                self.d_free |= set(self.d_decoding.pop(tid))
            for probe in self.probes:
                self.perform("d", self.d.probe_answered(probe.peer, probe.rank, f"p{self.p_incarnation}", self.now))
            self.probes.clear()
        assert not self.p.live() and not self.d.live()
        assert not self.in_flight
        assert self.p_free == set(range(POOL)), "I4: P blocks leaked"
        assert self.d_free == set(range(POOL)), "I4: D blocks leaked"


PushProtocol.TestCase.settings = settings(
    max_examples=int(__import__("os").environ.get("STATEFUL_EXAMPLES", "150")),
    stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestPushProtocol = pytest.mark.slow(PushProtocol.TestCase)  # 150 random runs of 60 steps


def test_the_push_state_machine_test_catches_a_decode_that_frees_quarantined_blocks_at_once(monkeypatch):
    # A quarantined transfer's blocks wait for their fence: P, only stopped, may still write into
    # them. A table that frees them at once hands vLLM blocks a late write can land in.
    monkeypatch.setitem(consumer.TABLE, (DState.REGISTERED, DEvent.SUSPECTED),
                        Rule(DState.FAILED, (DEffect.SEND_CANCEL, DEffect.FREE_BLOCKS, DEffect.QUARANTINE)))
    # Caught where the harness takes the quarantine over (the blocks are no longer D's to hold),
    # where a late write lands in them (I2), or where their books no longer balance at the end (I4).
    # Generation only: shrinking would take most of a minute.
    with pytest.raises(AssertionError, match="quarantined twice or unowned|I2|I4"):
        run_state_machine_as_test(PushProtocol, settings=settings(
            PushProtocol.TestCase.settings, max_examples=300, derandomize=True, database=None,
            phases=[Phase.generate]))


_P, _PE, _PF = producer.PState, producer.PEvent, producer.PEffect
STREAM_BREAKAGES = {
    # The last write is posted while a chunk write is still in flight: its notification may overtake it.
    "notified before the chunks landed": (
        (_P.STREAMING, _PE.KV_READY), Rule(_P.WRITING, (_PF.HOLD_BLOCKS, _PF.SUBMIT_WRITE)), "second write in flight"),
    # The prefill request ends under a chunk write and D is told at once: D frees blocks being written.
    "failed under a chunk write": (
        (_P.STREAMING, _PE.ABORT), Rule(_P.FAILED, (_PF.NOTIFY_FAILED, _PF.FAIL), "aborted"), "I2"),
}


@pytest.mark.parametrize("breakage", sorted(STREAM_BREAKAGES))
def test_the_push_state_machine_test_catches_each_broken_streaming_row(monkeypatch, breakage):
    key, row, caught_as = STREAM_BREAKAGES[breakage]
    monkeypatch.setitem(producer.TABLE, key, row)
    with pytest.raises(AssertionError, match=caught_as):
        run_state_machine_as_test(PushProtocol, settings=settings(
            PushProtocol.TestCase.settings, max_examples=300, derandomize=True, database=None,
            phases=[Phase.generate]))


def preempted_under_a_chunk_write(machine: PushProtocol) -> None:
    """The race by hand: a chunk write in flight when the engine preempts the prefill and hands its
    blocks to another request, so the write carries that request's bytes; the prefill is computed
    again in the same blocks (the lowest free ones) and finishes, and D decodes."""
    machine.clocks_disagree(0.0)
    machine.request_streams(length=4, hit=0, steps=2)
    (tid,) = machine.in_flight
    machine.prefill_is_preempted(0)
    machine.write_lands(0)  # another request's bytes land in D's first two blocks
    machine.prefill_finishes(0, "not")
    while machine.in_flight or machine.to_d:
        if machine.in_flight:
            machine.write_lands(0)
        while machine.to_d:
            machine.deliver(False, machine.to_d.pop(0))
    assert tid in machine.d_decoding


def test_a_prefill_preempted_under_a_chunk_write_is_written_again_before_d_decodes_it():
    machine = PushProtocol()
    preempted_under_a_chunk_write(machine)  # finish_load checks every position's bytes (I7)
    assert machine.p.counters["stream_rewritten"] == 1
    machine.teardown()


def test_the_preemption_race_is_caught_when_the_stream_is_not_written_again(monkeypatch):
    monkeypatch.setitem(producer.TABLE, (_P.STREAMING, _PE.PREEMPTED), Rule(None))
    with pytest.raises(AssertionError, match="I7: .* position 0 corrupt"):
        preempted_under_a_chunk_write(PushProtocol())
