"""The push writer and receiver threads over the in-memory transport and real loopback side
channels: their lifecycle, isolation from slow peers, and error propagation."""

import base64
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from neuron_disagg.protocol import AgentInfoRequest, TransferId, WireCodec, WriteDone
from neuron_disagg.testing.peer import Peer, parser
from neuron_disagg.transfer import thread as thread_module


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", "thread-test-secret-0123456789abcdef")


class Rank:
    """An in-process peer whose events land in a list."""

    def __init__(self, role, *args):
        self.events, self.cond = [], threading.Condition()
        self.peer = Peer(parser().parse_args(["--role", role, "--transport", "memory", *args]), self.emit)

    def emit(self, obj):
        with self.cond:
            self.events.append({**obj, "seen_at": time.monotonic()})
            self.cond.notify_all()

    def wait(self, kind, tid, timeout=5.0):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.events:
                    if e["event"] == kind and e["tid"] == list(tid):
                        return e
                assert time.monotonic() < deadline, f"no {kind} for {tid}: {self.events}"
                self.cond.wait(0.05)

    def events_of(self, kind):
        with self.cond:
            return [e for e in self.events if e["event"] == kind]

    def __getattr__(self, op):
        return lambda **kw: self.peer.command({"op": op, **kw})

    def close(self):
        self.peer.shutdown()


@pytest.fixture
def ranks():
    made = []

    def make(role, *args):
        made.append(Rank(role, *args))
        return made[-1]

    yield make
    for rank in made:
        rank.close()


def _register(d, p, tid, blocks):
    d.expect(tid=list(tid), p_address=p.peer.address)
    d.allocate(tid=list(tid), blocks=blocks)


def test_a_slow_handshake_does_not_delay_writes_to_other_peers(ranks):
    p = ranks("prefill")
    slow, fast = ranks("decode"), ranks("decode")
    release = threading.Event()
    original = slow.peer.server.on_message

    def stalls_handshakes(message):
        if isinstance(message, AgentInfoRequest):
            release.wait(10)
        return original(message)

    slow.peer.server.on_message = stalls_handshakes
    _register(slow, p, ("to-slow", 0), [1, 2])
    _register(fast, p, ("to-fast", 0), [1, 2])
    time.sleep(0.2)  # both registrations reach P
    p.kv_ready(tid=["to-slow", 0], blocks=[1, 2])
    p.kv_ready(tid=["to-fast", 0], blocks=[3, 4])
    started = time.monotonic()
    fast.wait("loaded", ("to-fast", 0), timeout=5.0)
    assert time.monotonic() - started < 5.0  # the slow peer's handshake is held for 10 s
    assert not any(e["event"] == "loaded" for e in slow.events)
    release.set()
    slow.wait("loaded", ("to-slow", 0))


def test_shutdown_fails_held_transfers_frees_their_blocks_and_joins(ranks):
    p = ranks("prefill", "--lease-s", "60")
    p.kv_ready(tid=["held", 0], blocks=[5, 6])
    time.sleep(0.1)
    started = time.monotonic()
    p.peer.thread.shutdown(timeout_s=2)
    assert time.monotonic() - started < 2
    assert p.wait("free", ("held", 0))["blocks"] == [5, 6]
    assert not p.peer.thread._thread.is_alive()


def test_an_error_in_the_thread_is_re_raised_by_shutdown(ranks):
    p = ranks("prefill", "--lease-s", "0.2")

    class Broken:
        def put(self, result):
            raise ValueError("the outbox exploded")

    p.peer.thread.outbox = Broken()
    p.kv_ready(tid=["boom", 0], blocks=[7])
    time.sleep(0.5)  # the lease lapses and reporting the free raises on the writer thread
    with pytest.raises(RuntimeError, match="push-writer-0 failed") as err:
        p.peer.thread.shutdown()
    assert isinstance(err.value.__cause__, ValueError)


def test_receiver_rejects_forged_notifications_and_counts_them(ranks):
    p, d = ranks("prefill"), ranks("decode")
    _register(d, p, ("victim", 0), [9])
    forged = WireCodec(b"forger-secret-0123456789abcdef!!").encode(WriteDone(TransferId("victim"), 0, 1))
    d.peer.transport._inbox.append((p.peer.agent, forged))
    deadline = time.monotonic() + 10
    while not d.peer.thread.rejected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d.peer.thread.rejected["bad_signature"] == 1
    assert not any(e["event"] == "loaded" for e in d.events)


def test_threads_are_named_per_rank(ranks):
    ranks("prefill"), ranks("decode")
    names = {t.name for t in threading.enumerate()}
    assert "neuron-disagg-push-writer-0" in names and "neuron-disagg-push-receiver-0" in names


class _HeldFence:
    """A device fence the test releases: the KV is not in memory until then."""

    def __init__(self):
        self.passed = threading.Event()
        self.waited = threading.Event()

    def ready(self):
        return self.passed.is_set()

    def wait(self):
        self.waited.set()
        self.passed.wait(5)


def test_writer_posts_nothing_before_the_engines_fence_passes(ranks):
    p, d = ranks("prefill"), ranks("decode")
    _register(d, p, ("fenced", 0), [1, 2])
    time.sleep(0.2)  # the registration reaches P first: only the fence holds the write back
    fence = _HeldFence()
    p.peer.thread.kv_ready(TransferId("fenced"), (3, 4), fence)
    assert fence.waited.wait(10)
    time.sleep(0.2)
    assert not any(e["event"] == "loaded" for e in d.events)
    fence.passed.set()
    d.wait("loaded", ("fenced", 0))


class StandInTorchNeuron:
    """``torch.neuron`` as TorchNeuron's native route has it: ``synchronize`` returns once the device
    has run what was queued — here, once the test releases it. ``events``: also Event/current_stream."""

    def __init__(self, events: bool):
        self.device_done = threading.Event()
        self.synchronized = threading.Event()
        if events:
            stand_in = self

            class Event:
                def record(self, stream):
                    self.stream = stream

                def query(self):
                    return stand_in.device_done.is_set()

                def synchronize(self):
                    stand_in.synchronize()

            self.Event, self.current_stream = Event, lambda device=None: f"stream of {device}"

    def synchronize(self, device=None):
        self.synchronized.set()
        self.device_done.wait(5)


@pytest.mark.parametrize("events", [False, True], ids=["synchronize", "event"])
def test_neuron_native_fence_holds_the_write_until_the_device_ran(ranks, monkeypatch, events, tmp_path):
    """The Neuron platform's fence on the native ``neuron`` device, through the real writer thread."""
    import sys
    import types
    from neuron_disagg.platforms.neuron import NeuronPlatform

    neuron = StandInTorchNeuron(events)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(neuron=neuron))
    platform = NeuronPlatform(str(tmp_path))
    neuron.device_done.set()  # start-up drains the (empty) queue before NIXL exists
    platform.use_kv_device(types.SimpleNamespace(type="neuron", index=0))
    neuron.device_done.clear()
    neuron.synchronized.clear()
    p, d = ranks("prefill"), ranks("decode")
    _register(d, p, ("neuron", 0), [1, 2])
    time.sleep(0.2)  # the registration reaches P first: only the fence holds the write back
    p.peer.thread.kv_ready(TransferId("neuron"), (3, 4), platform.wait_for_kv())
    assert neuron.synchronized.wait(2), "the writer waits on the device before reading the KV"
    time.sleep(0.2)
    assert not any(e["event"] == "loaded" for e in d.events)
    neuron.device_done.set()
    d.wait("loaded", ("neuron", 0))


def test_registration_reaches_prefill_only_after_the_decode_fence(ranks):
    """D's engine zeroes fresh blocks on its stream: P must not hear of them (and write) before."""
    from neuron_disagg.protocol import RankRegions, Registration

    p, d = ranks("prefill"), ranks("decode")
    tid = TransferId("zeroed")
    d.expect(tid=[tid.request, tid.attempt], p_address=p.peer.address)
    registrations = []
    original = p.peer.server.on_message
    p.peer.server.on_message = lambda m: (registrations.append(m) if isinstance(m, Registration) else None,
                                          original(m))[1]
    fence = _HeldFence()
    peer = d.peer
    reg = Registration(tid, peer.agent, "d-zeroed", peer.address, 1, (RankRegions(0, peer.agent, peer.regions),),
                       (1, 2), 0, 0.0)
    d.peer.thread.allocated(reg, fence)
    assert fence.waited.wait(10)
    time.sleep(0.2)
    assert not registrations
    fence.passed.set()
    deadline = time.monotonic() + 10
    while not registrations and time.monotonic() < deadline:
        time.sleep(0.02)
    assert registrations


def _until(condition, what, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _warm(p, d, blocks):
    """One transfer first, so that P's agent has D's loaded (what a request builds ahead needs)."""
    _register(d, p, ("warm", 0), blocks)
    p.fill(blocks=blocks, seed=2)
    p.kv_ready(tid=["warm", 0], blocks=blocks)
    d.wait("loaded", ("warm", 0))


def _built_ahead(ranks, tid, seed, announced=(2, 3)):
    """P holds KV in blocks 2, 3 for ``tid``; D registered 4, 5; P's engine announced ``announced``
    and the writer built the write for them. Returns (p, d)."""
    p, d = ranks("prefill"), ranks("decode")
    _warm(p, d, [1])
    p.fill(blocks=[2, 3], seed=seed)
    live = p.stats()["live"]
    _register(d, p, tid, [4, 5])
    _until(lambda: p.stats()["live"] > live, "D's registration never reached P")
    p.kv_coming(tid=list(tid), blocks=list(announced))
    _until(lambda: len(p.peer.transport.prepared_live) == 1, "the write was not built ahead")
    return p, d


def test_a_write_built_during_the_last_forward_is_only_posted_after_it(ranks):
    tid = ("built", 0)
    p, d = _built_ahead(ranks, tid, seed=3)
    p.kv_ready(tid=list(tid), blocks=[2, 3])
    d.wait("loaded", tid)
    assert d.digest(blocks=[4, 5]) == p.digest(blocks=[2, 3])
    assert p.peer.thread.stats["prepared_posted"] == 1
    assert not p.peer.transport.prepared_live


@pytest.mark.parametrize("then", ["kv ready in other blocks", "D cancels", "D's agent is loaded again"])
def test_a_write_built_ahead_and_not_posted_is_released(ranks, then):
    """Built for blocks the prefill did not end in, for a transfer that ended, or against metadata
    of D's since replaced: never posted, always released; the KV still lands exactly."""
    tid = ("unused", 0)
    p, d = _built_ahead(ranks, tid, seed=4, announced=(6, 7) if then == "kv ready in other blocks" else (2, 3))
    if then == "D cancels":
        d.abort(tid=list(tid), reason="client disconnected")
        _until(lambda: not p.peer.transport.prepared_live, "what was built for a cancelled transfer was kept")
        return
    if then == "D's agent is loaded again":
        p.peer.transport.add_peer(d.peer.agent.encode())
    p.kv_ready(tid=list(tid), blocks=[2, 3])
    d.wait("loaded", tid)
    assert d.digest(blocks=[4, 5]) == p.digest(blocks=[2, 3])
    assert p.peer.thread.stats["prepared_posted"] == 0
    assert not p.peer.transport.prepared_live


def test_a_transport_that_needs_it_gets_a_new_agent_after_a_failed_write(ranks):
    """LIBFABRIC's agent is unusable after a write to a dead peer (measured; see transport.py): the
    writer replaces it and later writes, also to peers the old agent knew, land."""
    p, good, dead = ranks("prefill"), ranks("decode"), ranks("decode")
    p.peer.transport.reset_after_failure = True
    p.fill(blocks=[1, 2], seed=1)
    _register(good, p, ("warm", 0), [1, 2])
    p.kv_ready(tid=["warm", 0], blocks=[1, 2])
    good.wait("loaded", ("warm", 0))

    p.peer.transport.fail_posts_to.add(dead.peer.agent)
    _register(dead, p, ("doomed", 0), [3])
    time.sleep(0.2)
    p.kv_ready(tid=["doomed", 0], blocks=[3])
    assert dead.wait("failed", ("doomed", 0))["reason"]
    assert p.wait("free", ("doomed", 0))["blocks"] == [3]

    _register(good, p, ("after", 0), [4, 5])
    p.kv_ready(tid=["after", 0], blocks=[1, 2])
    good.wait("loaded", ("after", 0))
    assert good.digest(blocks=[4, 5]) == p.digest(blocks=[1, 2])
    assert p.peer.transport.name == f"{p.peer.agent}-writer.1"
    assert p.peer.thread.stats["agent_resets"] == 1


def test_without_the_need_a_failed_write_keeps_the_agent(ranks):
    p, dead = ranks("prefill"), ranks("decode")
    p.peer.transport.fail_posts_to.add(dead.peer.agent)
    _register(dead, p, ("doomed", 0), [3])
    time.sleep(0.2)
    p.kv_ready(tid=["doomed", 0], blocks=[3])
    p.wait("free", ("doomed", 0))
    assert p.peer.transport.name == f"{p.peer.agent}-writer"
    assert p.peer.thread.stats["agent_resets"] == 0


def test_the_receiver_polls_closely_only_once_p_says_it_is_writing(ranks):
    """A registration waits out P's whole prefill in push: D's receiver must not spin through it.
    It polls closely from P's WriteStarting until the transfer ends, and without the hint the KV
    still arrives, by the next tick."""
    p, d = ranks("prefill"), ranks("decode", "--watchdog-s", "20")  # loaded, not given up, proves the tick
    receiver = d.peer.thread
    tid = ("hinted", 0)
    _register(d, p, tid, [1, 2])
    time.sleep(0.3)  # the registration reached P; P's prefill "runs"
    assert not receiver._busy()
    p.kv_ready(tid=list(tid), blocks=[3, 4])
    d.wait("loaded", tid)
    assert not receiver._busy()
    dropped = ("unhinted", 0)
    original = receiver.deliver
    receiver.deliver = lambda m: None if type(m).__name__ == "WriteStarting" else original(m)
    _register(d, p, dropped, [5, 6])
    time.sleep(0.3)
    p.kv_ready(tid=list(dropped), blocks=[7, 8])
    d.wait("loaded", dropped, timeout=10)


class _WaitsSeen(queue.SimpleQueue):
    """A thread's inbox that records the timeout of each wait for an item: what the thread chose to
    sleep for, whatever the machine's load did to when it woke."""

    def __init__(self):
        super().__init__()
        self.timeouts = []

    def get(self, block=True, timeout=None):
        self.timeouts.append(timeout)
        return super().get(block, timeout)


def test_an_idle_thread_sleeps_until_work_arrives_and_ticks_only_while_a_transfer_is_live(ranks, monkeypatch):
    """An instance with nothing in flight must cost its core (almost) nothing: the writer sleeps
    until an item arrives (no tick), and the receiver, whose agent P writes into, wakes to poll its
    transport only every ``idle_progress_s``. Ticks (deadlines) run while any transfer is live;
    ended ones wait as tombstones, no tick needed."""
    monkeypatch.setattr(thread_module, "queue", SimpleNamespace(SimpleQueue=_WaitsSeen, Empty=queue.Empty))
    p, d = ranks("prefill"), ranks("decode")
    writer, receiver = p.peer.thread, d.peer.thread
    want_idle = {writer: None, receiver: receiver.idle_progress_s}
    assert receiver.idle_progress_s is not None and receiver.idle_progress_s > writer.tick_interval_s

    def waits(thread, since=0):
        return thread._inbox.timeouts[since:]

    def idle_for(seconds):
        for thread, idle in want_idle.items():
            _until(lambda: waits(thread)[-1:] == [idle], f"{thread._thread.name} not waiting {idle}", 10)
        seen = {thread: len(waits(thread)) for thread in want_idle}
        time.sleep(seconds)
        for thread, idle in want_idle.items():
            assert set(waits(thread, seen[thread] - 1)) == {idle}, waits(thread, seen[thread] - 1)
    idle_for(0.5)
    tid = ("live", 0)
    seen = {thread: len(waits(thread)) for thread in want_idle}
    _register(d, p, tid, [1, 2])
    for thread in want_idle:  # live: deadlines are watched (P holds D's registration)
        _until(lambda: writer.tick_interval_s in waits(thread, seen[thread]),
               f"{thread._thread.name} not ticking", 10)
    p.kv_ready(tid=list(tid), blocks=[3, 4])
    d.wait("loaded", tid)
    idle_for(0.5)


@pytest.mark.parametrize("frames", ["forged", "for another transfer", "garbage"])
def test_the_pull_reader_refuses_an_offer_it_cannot_verify_and_frees_the_blocks(ranks, frames):
    """D's reader checks the offers the decode leg carried (off the engine loop): a forged one, or
    none for this prompt's transfer, fails the load with the reason and returns the blocks at once."""
    p, d = ranks("prefill", "--mode", "pull"), ranks("decode", "--mode", "pull")
    tid = ("refused", 0)
    offer = base64.b64decode(p.lend(tid=list(tid), blocks=[1, 2])["offer"])
    sent = {"forged": offer[:-1] + bytes([offer[-1] ^ 1]),
            "for another transfer": base64.b64decode(p.lend(tid=["other", 0], blocks=[3])["offer"]),
            "garbage": b"not an offer"}[frames]
    d.offered(tid=list(tid), offer=base64.b64encode(sent).decode())
    d.allocate(tid=list(tid), blocks=[5, 6])
    assert "offer rejected" in d.wait("failed", tid)["reason"]
    assert sorted(d.wait("free", tid)["blocks"]) == [5, 6]
    assert sum(d.stats()["notifications_rejected"].values()) == 1
    assert d.stats()["outstanding_blocks"] == 0 and not d.events_of("loaded")
    # the same reader still reads a good offer
    good = ("accepted", 0)
    d.offered(tid=list(good), offer=p.lend(tid=list(good), blocks=[7])["offer"])
    d.allocate(tid=list(good), blocks=[8])
    d.wait("loaded", good)


def _wait_for_state(rank, tid, state):
    def now():
        entry = rank.peer.core.entries.get(TransferId(*tid))
        return entry.state.value if entry else None
    _until(lambda: now() == state, f"{tid} never {state}", 10)


def test_a_write_p_gave_up_on_keeps_p_blocks_and_d_untold_until_it_ends(ranks):
    """Releasing a write does not stop it (an RDMA op in flight: the transport here completes a
    stalled one when told, released or not). After max_write_s P stops waiting, but frees its
    blocks and answers D only once the write ended; one that ends then is D's KV after all."""
    # max_write_s 3: the drain, in which the test looks, lasts as long, however loaded the machine
    p, d = ranks("prefill", "--max-write-s", "3"), ranks("decode", "--watchdog-s", "20")
    _warm(p, d, [1])
    p.fill(blocks=[2, 3], seed=5)
    p.peer.transport.stall_posts_to.add(d.peer.agent)
    tid = ("stalled", 0)
    _register(d, p, tid, [4, 5])
    p.kv_ready(tid=list(tid), blocks=[2, 3])
    _wait_for_state(p, tid, "draining")  # past max_write_s (3); the drain ends a max_write_s later
    assert not [e for e in p.events_of("free") if e["tid"] == list(tid)]
    assert not [e for e in d.events_of("failed") if e["tid"] == list(tid)]
    assert p.peer.transport.land_stalled() == 1
    d.wait("loaded", tid)
    assert p.wait("free", tid)["blocks"] == [2, 3]
    assert d.digest(blocks=[4, 5]) == p.digest(blocks=[2, 3])


def test_a_write_that_never_ends_is_released_and_answered_after_the_drain(ranks):
    p, d = ranks("prefill", "--max-write-s", "0.5"), ranks("decode", "--watchdog-s", "20")
    _warm(p, d, [1])
    p.peer.transport.stall_posts_to.add(d.peer.agent)
    tid = ("never", 0)
    _register(d, p, tid, [4])
    p.kv_ready(tid=list(tid), blocks=[2])
    started = time.monotonic()
    assert p.wait("free", tid)["blocks"] == [2]
    assert time.monotonic() - started >= 0.9  # 2 x max_write_s, less a tick
    assert "max_write_s" in d.wait("failed", tid)["reason"]


def test_a_read_d_gave_up_on_keeps_its_blocks_until_it_ends_and_still_recomputes(ranks):
    """Pull: a READ past max_read_s may still land in D's blocks. They go back to vLLM, failed
    (D computes the prompt), only once the READ ended or a second max_read_s passed."""
    p = ranks("prefill", "--mode", "pull")
    d = ranks("decode", "--mode", "pull", "--max-write-s", "3", "--watchdog-s", "20")
    warm = ("warm-read", 0)
    d.offered(tid=list(warm), offer=p.lend(tid=list(warm), blocks=[1])["offer"])
    d.allocate(tid=list(warm), blocks=[1])
    d.wait("loaded", warm)
    d.peer.transport.stall_posts_to.add(p.peer.agent)
    tid = ("stalled-read", 0)
    d.offered(tid=list(tid), offer=p.lend(tid=list(tid), blocks=[2, 3])["offer"])
    d.allocate(tid=list(tid), blocks=[5, 6])
    _wait_for_state(d, tid, "draining")  # past max_read_s (3): the test looks within the drain, as long
    assert not [e for e in d.events_of("free") if e["tid"] == list(tid)]
    assert d.peer.transport.land_stalled() == 1
    assert "max_read_s" in d.wait("failed", tid)["reason"]
    assert sorted(d.wait("free", tid)["blocks"]) == [5, 6]
    assert not [e for e in d.events_of("loaded") if e["tid"] == list(tid)]


def test_a_chunk_write_that_fails_to_post_fails_the_transfer_and_d_hears_why(ranks):
    p, d = ranks("prefill"), ranks("decode", "--watchdog-s", "20")
    p.peer.transport.fail_posts_to.add(d.peer.agent)
    tid = ("chunk-unposted", 0)
    p.fill(blocks=[1, 2, 3], seed=9)
    _register(d, p, tid, [4, 5, 6])
    _wait_for_state(p, tid, "awaiting_kv")
    p.kv_chunk(tid=list(tid), blocks=[1, 2])
    assert "not reachable" in d.wait("failed", tid)["reason"]
    assert d.wait("free", tid)["blocks"] == [4, 5, 6]
    p.kv_ready(tid=list(tid), blocks=[1, 2, 3])  # the prefill ends after its transfer failed
    assert p.wait("free", tid)["blocks"] == [1, 2, 3]  # its blocks go back at once


def test_a_prefill_that_ends_under_a_chunk_write_tells_d_only_once_the_write_ended(ranks):
    """vLLM frees an aborted prefill's blocks at once, so a chunk write still in flight may read
    another request's bytes into D's blocks: D must neither decode nor free them before it ends."""
    p, d = ranks("prefill"), ranks("decode", "--watchdog-s", "20")
    _warm(p, d, [1])
    p.peer.transport.stall_posts_to.add(d.peer.agent)
    tid = ("aborted-mid-stream", 0)
    _register(d, p, tid, [4, 5, 6])
    _wait_for_state(p, tid, "awaiting_kv")
    p.kv_chunk(tid=list(tid), blocks=[2, 3])
    _wait_for_state(p, tid, "streaming")
    p.abort(tid=list(tid), reason="client disconnected")
    _wait_for_state(p, tid, "aborting")
    time.sleep(0.3)
    assert not [e for e in d.events if e["event"] in ("failed", "free") and e["tid"] == list(tid)]
    assert p.peer.transport.land_stalled() == 1
    assert "aborted" in d.wait("failed", tid)["reason"]
    assert d.wait("free", tid)["blocks"] == [4, 5, 6]
    assert not [e for e in d.events_of("loaded") if e["tid"] == list(tid)]


def test_a_chunk_handed_before_its_forward_is_posted_group_by_group_as_its_layers_are_fenced(ranks):
    """Streaming by layers: the step's blocks reach the writer before the forward computes them, so
    nothing of a group may be read before its fence is ready. A writer that posted the whole chunk at
    once (the gates ignored) would land the second group while its layers were still being computed."""
    from neuron_disagg.platforms.fence import LayerFences

    p, d = ranks("prefill"), ranks("decode")
    tid, src, dst = ("by-layers", 0), [3, 4], [1, 2]
    p.fill(blocks=src, seed=5)
    _register(d, p, tid, dst)
    _until(lambda: p.stats()["live"] == 1, "P never got the registration")
    half = len(p.peer.regions) // 2  # layers 0-1 (K and V planes) then layers 2-3
    fences = [_HeldFence(), _HeldFence()]
    recorded = iter(fences)
    layers = LayerFences({"early": 0, "late": 1}, tuple(i // half for i in range(2 * half)), 2, lambda: next(recorded))

    def landed():  # per region: D's two blocks hold P's
        return [all(d.read(block=b)["regions"][r] == p.read(block=s)["regions"][r] for s, b in zip(src, dst, strict=True))
                for r in range(2 * half)]

    p.peer.rank.push.kv_chunk(TransferId(*tid), tuple(src), layers)
    time.sleep(0.2)
    assert not any(landed())  # no layer has run
    layers.saved("early")  # the engine records group 0's fence; the device has not passed it
    time.sleep(0.2)
    assert not any(landed())
    fences[0].passed.set()
    _until(lambda: all(landed()[:half]), "the first group never landed")
    time.sleep(0.2)
    assert not any(landed()[half:])  # its layers ran; the second group's have not
    layers.saved("late")
    fences[1].passed.set()
    _until(lambda: all(landed()), "the second group never landed")
    assert not d.events_of("loaded")  # chunks: D hears of the transfer only with the last write
    p.kv_ready(tid=list(tid), blocks=src)
    d.wait("loaded", tid)
    writer = p.peer.rank.push.stats
    assert writer["chunk_writes"] == 1 and writer["layer_parts"] == 2 and writer["writes"] == 1


def test_a_chunk_whose_forward_ended_before_the_writer_saw_it_goes_whole(ranks):
    """The step's fences all ready when the writer plans (the forward outran it): one part, no gates."""
    from neuron_disagg.platforms.fence import LayerFences, ReadyFence

    p, d = ranks("prefill"), ranks("decode")
    tid = ("late-writer", 0)
    p.fill(blocks=[3], seed=6)
    _register(d, p, tid, [1])
    _until(lambda: p.stats()["live"] == 1, "P never got the registration")
    layers = LayerFences({"only": 0}, (0,) * len(p.peer.regions), 1, ReadyFence)
    layers.finish(ReadyFence())
    p.peer.rank.push.kv_chunk(TransferId(*tid), (3,), layers)
    p.kv_ready(tid=list(tid), blocks=[3])
    d.wait("loaded", tid)
    assert d.digest(blocks=[1]) == p.digest(blocks=[3])
    assert p.peer.rank.push.stats["layer_parts"] == 0


def test_parts_still_waiting_on_their_layers_when_the_request_ends_are_never_posted(ranks):
    """The prefill request ends (vLLM may reuse its blocks at once) while a chunk write waits on the
    running forward's layers: what was not posted never is, and D hears WriteFailed only once the
    write ended. A writer that posted the rest when the gates opened would read reused blocks."""
    from neuron_disagg.platforms.fence import LayerFences

    p, d = ranks("prefill"), ranks("decode")
    tid, src, dst = ("ended-mid-forward", 0), [3, 4], [1, 2]
    p.fill(blocks=src, seed=7)
    _register(d, p, tid, dst)
    _until(lambda: p.stats()["live"] == 1, "P never got the registration")
    half = len(p.peer.regions) // 2
    held = _HeldFence()
    layers = LayerFences({"early": 0, "late": 1}, tuple(i // half for i in range(2 * half)), 2, lambda: held)
    p.peer.rank.push.kv_chunk(TransferId(*tid), tuple(src), layers)
    time.sleep(0.2)
    p.abort(tid=list(tid))
    time.sleep(0.2)
    layers.saved("early"), layers.saved("late")
    held.passed.set()  # the forward's layers ran after all, the blocks maybe another request's now
    d.wait("failed", tid)
    time.sleep(0.3)
    assert not any(int(region, 16) for b in dst for region in d.read(block=b)["regions"])  # nothing landed
    assert p.peer.rank.push.stats["gated_parts_dropped"] == 2
