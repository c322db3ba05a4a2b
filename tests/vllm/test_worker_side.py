"""The connector's worker side with stand-ins for its transfer threads: what each step's metadata
hands them, and what they report through the rank's outbox (from any thread) turns into for vLLM —
loaded, failed with its blocks, aborted while loading, sent only once vLLM listed the request
finished — plus the stats it reports, as changes since the last report."""

from __future__ import annotations

import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from neuron_disagg.config import Config  # noqa: E402
from neuron_disagg.platforms.fence import ReadyFence  # noqa: E402
from neuron_disagg.platforms.kv_layout import LayerGroups  # noqa: E402
from neuron_disagg.protocol import RankRegions, Registration, TransferId  # noqa: E402
from neuron_disagg.protocol.geometry import ModelShape, rank_regions  # noqa: E402
from neuron_disagg.timeline import OFF  # noqa: E402
from neuron_disagg.transfer.outbox import Failed, Freed, Loaded, Quarantined  # noqa: E402
from neuron_disagg.transfer.rank import Rank  # noqa: E402
from neuron_disagg.transfer.thread import _STOP, TransferThread, TransferThreadDied  # noqa: E402
from neuron_disagg.transfer.transport import InMemoryTransport  # noqa: E402
from neuron_disagg.vllm.decode import DecodeWorker  # noqa: E402
from neuron_disagg.vllm.metadata import (  # noqa: E402
    Abort, AllocatedBlocks, Expect, HandOff, QuarantineNotices, ReadOffer, StepMetadata,
)
from neuron_disagg.vllm.prefill import PrefillWorker  # noqa: E402
from neuron_disagg.vllm.worker import WorkerSide  # noqa: E402

SECRET = "worker-side-tests-secret-0123456789"
TID, RID = TransferId("req.1", 0, "abc"), "cmpl-req.1-0"


class Thread:
    """Records what the worker side hands a transfer thread."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.core = SimpleNamespace(counters=Counter())
        self.rejected: Counter = Counter()
        self.stats: Counter = Counter()
        self.timeline = OFF
        self.cpu_seconds = 0.0

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))

    def check(self):
        pass

    def expecting_a_landing(self):
        return False

    def shutdown(self):
        pass


@pytest.fixture
def worker(monkeypatch):
    """A worker side of ``role`` around a real rank (in-memory agents, a side channel not started)
    whose threads are recorders."""
    monkeypatch.setenv("NEURON_DISAGG_SECRET", SECRET)
    made = []

    def make(role: str, recompute: bool = True) -> WorkerSide:
        side = (PrefillWorker if role == "prefill" else DecodeWorker)(
            Config(), "engine-a", 0, 1, total_heads=4, recompute=recompute)
        side.rank = Rank(role, 0, 1, (), codec=side.codec, agent_name=f"engine-a-rank0-{len(made)}",
                         side_channel_host="127.0.0.1", side_channel_port=0, transport=InMemoryTransport)
        side.rank.push, side.rank.pull = Thread(), Thread()
        side.platform = SimpleNamespace(wait_for_kv=lambda: "fence")
        side.rank_regions = RankRegions(0, side.agent_name, ())
        made.append(side)
        return side

    yield make
    for side in made:
        side.rank.server.close()


def report(side, *results):
    """What the rank's threads report, as they would (any thread)."""
    for result in results:
        side.rank.outbox.put(result)


def test_decode_registration_goes_to_the_receiver_and_a_load_is_reported_once(worker):
    d = worker("decode")
    d.hand_off(StepMetadata(expect=[Expect(TID, "p:5600", 2)], register=[AllocatedBlocks(TID, RID, (5, 6), 1)]))
    (expect, allocated) = d.rank.push.calls
    assert expect == ("expect", TID, "p:5600", 2)
    registration, fence = allocated[1:]
    assert isinstance(registration, Registration) and fence == "fence"
    assert (registration.block_ids, registration.first_block_index, registration.d_request_id) == ((5, 6), 1, RID)
    assert d.transfer_results(set()) == (set(), set(), set())  # in flight
    report(d, Loaded(TID))
    assert d.transfer_results(set()) == (set(), {RID}, set())
    assert d.transfer_results(set()) == (set(), set(), set())
    report(d, Loaded(TID))  # a late duplicate changes nothing
    assert d.transfer_results(set()) == (set(), set(), set())


def test_a_failed_load_is_reported_only_once_its_blocks_are_fenced_and_names_them(worker):
    d = worker("decode")
    d.hand_off(StepMetadata(register=[AllocatedBlocks(TID, RID, (5, 6), 0)]))
    report(d, Failed(TID, "lease expired"))
    assert d.transfer_results(set()) == (set(), set(), set())  # a write may still land: not yet
    report(d, Freed(TID, (5, 6)))
    assert d.transfer_results(set()) == (set(), {RID}, {RID})
    assert d.failed_blocks == {5, 6}  # vLLM < 0.32 learns of the failure by these
    assert d.transfer_results(set())[1:] == (set(), set()) and d.failed_blocks == set()


def test_a_quarantined_load_is_reported_failed_at_once_and_its_blocks_are_released_to_the_scheduler_later(worker):
    """P is gone: vLLM hears now that the load failed (the request goes on), and the scheduler side
    hears with the same step's output that the blocks stay quarantined, then that they are free."""
    d = worker("decode")
    d.hand_off(StepMetadata(register=[AllocatedBlocks(TID, RID, (5, 6), 1)]))
    report(d, Quarantined(TID, "prefill silent: no answer to a probe within suspect_after_s (p:5600 rank 0)"))
    assert d.transfer_results(set()) == (set(), {RID}, {RID})
    assert d.failed_blocks == {5, 6}  # vLLM < 0.32 learns of the failure by these
    assert d.worker_meta() == QuarantineNotices(held=[RID]) and d.worker_meta() is None
    assert d.transfer_results(set()) == (set(), set(), set())
    report(d, Freed(TID, (5, 6)))
    assert d.transfer_results(set()) == (set(), set(), set()), "vLLM was told once"
    assert d.worker_meta() == QuarantineNotices(released=[RID])
    assert (d.stats() or {})["counts"]["quarantines"] == 1


def test_a_quarantine_that_ends_before_vllm_heard_of_it_is_reported_as_held_and_released_together(worker):
    d = worker("decode")
    d.hand_off(StepMetadata(register=[AllocatedBlocks(TID, RID, (5,), 0)]))
    report(d, Quarantined(TID, "prefill unreachable"), Freed(TID, (5,)))
    assert d.transfer_results(set()) == (set(), {RID}, {RID})
    assert d.worker_meta() == QuarantineNotices(held=[RID], released=[RID])
    report(d, Freed(TID, (5,)))  # a late duplicate
    assert d.transfer_results(set()) == (set(), set(), set()) and d.worker_meta() is None


def test_aborted_while_loading_the_blocks_go_back_once_fenced_and_the_load_is_not_a_failure(worker):
    d = worker("decode")
    d.hand_off(StepMetadata(register=[AllocatedBlocks(TID, RID, (5,), 0)]))
    d.hand_off(StepMetadata(abort=[Abort(TID, "decode request aborted")]))
    assert ("abort", TID, "decode request aborted") in d.rank.push.calls
    assert ("abort", TID, "decode request aborted") in d.rank.pull.calls
    report(d, Freed(TID, (5,)))
    assert d.transfer_results(set()) == (set(), {RID}, set())


def test_prefill_reports_sent_only_for_requests_vllm_listed_finished_in_either_order(worker):
    p = worker("prefill")
    other = TransferId("req.2", 0, "def")
    p.hand_off(StepMetadata(kv_ready=[HandOff(TID, RID, (1, 2)), HandOff(other, "r2", (3,))]))
    assert [c[0] for c in p.rank.push.calls] == ["kv_ready", "kv_ready"]
    report(p, Freed(TID, (1, 2)))                                   # freed before vLLM listed it
    assert p.transfer_results({"plain-request"}) == (set(), set(), set())
    assert p.transfer_results({RID}) == ({RID}, set(), set())
    assert p.transfer_results({"r2"}) == (set(), set(), set())  # listed before freed
    report(p, Freed(other, (3,)))
    assert p.transfer_results(set()) == ({"r2"}, set(), set())
    assert not p._transfers  # a plain request's id was never kept


def test_a_pull_read_hands_the_legs_offers_unverified_to_the_reader_in_two_puts(worker):
    """Checking the offers' signatures is the reader's work, off the engine loop (transfer tests:
    a forged or foreign offer fails the load and frees its blocks)."""
    d = worker("decode")
    frames = (b"first prompt's offer", b"second prompt's offer")
    d.hand_off(StepMetadata(read=[ReadOffer(AllocatedBlocks(TID, RID, (7,), 2), frames)]))
    assert [c[0] for c in d.rank.pull.calls] == ["offered", "allocated"]
    assert d.rank.pull.calls[0][1:] == (TID, frames) and d.rank.pull.calls[1][1:4] == (TID, d.rank_regions, (7,))
    report(d, Failed(TID, "offer rejected: bad signature"))  # what the reader reports for a forged one
    report(d, Freed(TID, (7,)))
    assert d.transfer_results(set()) == (set(), {RID}, {RID}) and d.failed_blocks == {7}


@pytest.mark.parametrize("recompute", [True, False])
def test_stats_are_changes_since_the_last_report_and_the_fail_policy_keeps_each_reason(worker, recompute):
    d = worker("decode", recompute=recompute)
    d.hand_off(StepMetadata(register=[AllocatedBlocks(TID, RID, (5,), 0)]))
    report(d, Failed(TID, "lease expired"))
    first = d.stats()
    assert first["counts"] == {"transfers_failed": 1} and first["failures"] == {"lease expired": 1}
    assert first["recomputed"] == ({"lease expired": 1} if recompute else {})
    assert first["failed_requests"] == ({} if recompute else {"req.1#0": "lease expired"})
    assert d.stats() is None  # nothing new
    d.step_us.append(42.0)
    d.step_cpu_us.append(40.0)
    got = d.stats()
    assert (got["step_us"], got["step_cpu_us"]) == ([42.0], [40.0])


def test_a_prefill_its_step_completes_goes_to_the_writer_after_the_forward_with_a_fence(worker):
    p = worker("prefill")
    recorded: list[str] = []
    p.platform = SimpleNamespace(wait_for_kv=lambda: recorded.append("fence") or f"fence {len(recorded)}")
    p.hand_off(StepMetadata(kv_ready_after_forward=[HandOff(TID, RID, (1, 2))]))
    assert recorded == []  # its KV is still being computed: no fence yet
    assert p.rank.push.calls == [("kv_coming", TID, (1, 2))]  # but the writer may plan its write
    before = time.time()
    p.after_forward()
    (_, call) = p.rank.push.calls
    assert call[:4] == ("kv_ready", TID, (1, 2), "fence 1")  # a fence recorded behind the forward
    assert before <= call[4] <= time.time()  # when the KV was computed: the writer marks the timeline
    p.after_forward()
    assert len(p.rank.push.calls) == 2
    report(p, Freed(TID, (1, 2)))
    assert p.transfer_results({RID}) == ({RID}, set(), set())


def test_one_vllm_did_not_call_after_the_forward_goes_at_the_next_step_start(worker):
    p = worker("prefill")
    p.hand_off(StepMetadata(kv_ready_after_forward=[HandOff(TID, RID, (1, 2))]))
    p.hand_off(StepMetadata())  # e.g. a runner that defers wait_for_save
    assert [c[:3] for c in p.rank.push.calls] == [("kv_coming", TID, (1, 2)), ("kv_ready", TID, (1, 2))]


def test_under_async_scheduling_the_writer_hears_of_a_prefill_before_its_last_forward(worker):
    p = worker("prefill")
    p.hand_off(StepMetadata(kv_coming=[HandOff(TID, RID, (1, 2))]))
    p.after_forward()
    assert p.rank.push.calls == [("kv_coming", TID, (1, 2))]  # handed over only at the next step's start
    p.hand_off(StepMetadata(kv_ready=[HandOff(TID, RID, (1, 2))]))
    assert [c[:3] for c in p.rank.push.calls[1:]] == [("kv_ready", TID, (1, 2))]


def test_streaming_by_layers_hands_the_steps_blocks_over_before_its_forward_but_a_prompts_last_block(worker):
    """The last block rides with the notification on the last write, after the forward, so that it
    reaches every D rank as a NIXL notification after every byte; siblings whose prompt one forward
    ends (async scheduling names both) share one chunk."""
    p = worker("prefill")
    p._layer_groups = LayerGroups({"layer.0": 0, "layer.1": 1}, (0, 1), 2)
    recorded: list[ReadyFence] = []
    p.platform = SimpleNamespace(wait_for_kv=lambda: recorded.append(ReadyFence()) or recorded[-1])
    running = TransferId("req.2", 0, "def")
    p.hand_off(StepMetadata(chunks_after_forward=[HandOff(running, "cmpl-req.2-0", (5, 6))],
                            kv_coming=[HandOff(TID, RID, (1, 2, 3)), HandOff(TID, "sibling", (1, 2, 3))]))
    layers = p.layers_in_forward
    chunks = [c for c in p.rank.push.calls if c[0] == "kv_chunk"]
    assert chunks == [("kv_chunk", running, (5, 6), layers), ("kv_chunk", TID, (1, 2), layers)]
    assert recorded == []  # before the forward: nothing computed, nothing fenced
    layers.saved("layer.0")
    assert len(recorded) == 1 and layers.ready(0) and not layers.ready(1)  # group 0 fenced on the engine thread
    assert ("layers_fenced",) in p.rank.push.calls  # and the writer woken
    p.after_forward()
    assert p.layers_in_forward is None and layers.passed()  # the step's end fenced the rest
    assert not [c for c in p.rank.push.calls if c[0] == "kv_ready"]  # async: at the next step's start
    assert p._totals["layer_groups_hooked"] == 1 and p._totals["layer_groups_at_step_end"] == 1


def test_streaming_by_layers_lets_a_writes_descriptors_join_across_regions_only_within_a_group_of_layers(worker):
    """With the blocks outermost a block's layers lie back to back and its descriptors join across
    regions (plan.plan_rank_write); by layers each group's part goes once its layers ran, so the
    rank's planner gets each region's group as its join class; by steps, one class."""
    regions = rank_regions(ModelShape(num_layers=4, num_kv_heads=4, head_dim=8, dtype_bytes=2, block_tokens=4), 8)
    names = [f"layers.{i}" for i in range(4)]
    p = worker("prefill")
    p.config = Config(stream_layer_groups=2)
    p.platform = SimpleNamespace(stream_mode=lambda wanted, once: "layers")
    assert p._join(names, regions) == (0, 0, 0, 0, 1, 1, 1, 1)  # layers 0-1 (K and V each), then 2-3
    assert p._layer_groups.groups == 2
    by_steps = worker("prefill")
    by_steps.platform = SimpleNamespace(stream_mode=lambda wanted, once: "chunks")
    assert by_steps._join(names, regions) is None and by_steps._layer_groups is None


class Exploding(TransferThread):
    """A real transfer thread whose handler raises on the first item it takes."""

    core = SimpleNamespace(has_live=lambda: False)

    def __init__(self):
        super().__init__("neuron-disagg-push-receiver-0", SimpleNamespace(shutdown=lambda: None))
        self._handlers[str] = self._explode

    def _explode(self, item, now):
        raise KeyError(item)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_transfer_thread_that_died_stops_the_engine_loop_with_its_reason(worker, role):
    """Its transfers would otherwise wait forever holding their blocks, no request failing (a
    receiver dead of a bug hung every later push request on that D, and nothing said so)."""
    side = worker(role)
    side.hand_off(StepMetadata(register=[AllocatedBlocks(TID, RID, (5,), 0)]))
    assert side.transfer_results(set()) == (set(), set(), set())
    dead = side.rank.push = Exploding().start()
    dead._inbox.put("an item it cannot take")
    dead._thread.join(5)
    assert not dead._thread.is_alive()
    for _ in range(2):  # every step, not once: vLLM must not carry on past it
        with pytest.raises(TransferThreadDied, match=r"push-receiver-0 died \(KeyError.*restart it") as err:
            side.transfer_results(set())
        assert isinstance(err.value.__cause__, KeyError)


class Blocking(Exploding):
    """A real transfer thread whose handler blocks until released, as a call into a hung driver."""

    stuck_after_s = 0.8  # steps 0.05 s apart count as seen a quarter of it apart, oversleeping 4x

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self._handlers[str] = self._wait_in_the_driver

    def _wait_in_the_driver(self, item, now):
        self.release.wait(10)


def test_a_transfer_thread_stuck_in_one_call_stops_the_engine_loop_saying_where(worker):
    d = worker("decode")
    stuck = d.rank.push = Blocking().start()
    try:
        time.sleep(1.0)  # idle, waiting for work, for longer than stuck_after_s: not stuck
        for _ in range(10):
            d.transfer_results(set())
            time.sleep(0.05)
        stuck._inbox.put("work that never ends")
        deadline = time.monotonic() + 10
        with pytest.raises(TransferThreadDied, match=r"(?s)push-receiver-0 has been stuck for .* in _wait_in_the_driver"):
            while time.monotonic() < deadline:  # the engine steps on; within stuck_after_s and a step it stops
                d.transfer_results(set())
                time.sleep(0.05)
    finally:
        stuck.release.set()


def test_a_pause_of_the_whole_process_is_not_taken_for_a_stuck_thread(worker):
    """SIGSTOP (a hung host) stops the engine and the thread alike; on resume the engine's clock has
    run on while the thread is still in the turn it was in."""
    d = worker("decode")
    paused = d.rank.push = Blocking().start()
    try:
        paused._inbox.put("a turn the pause falls into")
        time.sleep(0.05)
        d.transfer_results(set())  # seen in that turn...
        time.sleep(1.0)            # ...the engine paused longer than stuck_after_s (no steps)...
        d.transfer_results(set())  # ...and on resume: not stuck yet
        paused.release.set()
        time.sleep(0.1)
        d.transfer_results(set())
    finally:
        paused.release.set()


class Busy(Exploding):
    """A real transfer thread whose handler computes for the time it is given."""

    core = SimpleNamespace(has_live=lambda: False, counters=Counter())

    def __init__(self):
        super().__init__()
        self.stats: Counter = Counter()
        self._handlers[float] = self._compute
        self._handlers[threading.Event] = lambda gate, now: gate.wait(5)

    def _compute(self, seconds, now):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass


def test_stats_report_each_transfer_threads_cpu_time_and_only_its_own(worker):
    """P's writer or D's receiver ("push") and the lender or reader ("pull"), in µs since start;
    the engine thread's own work is not theirs."""
    d = worker("decode")
    d.rank.push, d.rank.pull = Busy().start(), Busy().start()
    try:
        d.stats()
        gate = threading.Event()
        for item in (gate, 0.05, _STOP):  # held at the gate, the thread takes the work and the stop in one turn
            d.rank.push._inbox.put(item)
        end = time.thread_time() + 0.1  # the engine thread busy meanwhile
        while time.thread_time() < end:
            pass
        gate.set()
        d.rank.push.shutdown()  # already stopping: this waits for it
        counts = d.stats()["counts"]
        assert 50_000 <= counts["push_thread_cpu_us"] < 90_000
        assert counts.get("pull_thread_cpu_us", 0) < 10_000
    finally:
        d.rank.pull.shutdown()


def landing_in_flight(worker, wait_s: float, *, push: bool = True, pull: bool = False) -> WorkerSide:
    """A D whose receiver (push) or reader (pull) has KV on the wire into blocks registered for
    TID, with the landing wait set to ``wait_s`` (past the config's bound where a test needs a wait
    that only the landing can end)."""
    d = worker("decode")
    d.config = d.config.model_copy(update={"landing_wait_s": wait_s})
    d.hand_off(StepMetadata(register=[AllocatedBlocks(TID, RID, (5, 6), 0)]))
    d.rank.push.expecting_a_landing, d.rank.pull.expecting_a_landing = (lambda: push), (lambda: pull)
    return d


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_step_without_a_forward_waits_for_kv_in_flight_and_reports_it_as_it_lands(worker, mode):
    d = landing_in_flight(worker, 30.0, push=mode == "push", pull=mode == "pull")
    d.hand_off(StepMetadata(no_forward=True))
    started = time.monotonic()  # before the timer: on a loaded machine the timer may fire before this line runs
    reported: list[float] = []
    threading.Timer(1.0, lambda: (reported.append(time.monotonic()), report(d, Loaded(TID)))).start()
    waiting = time.monotonic()
    d.wait_for_landing()
    woke = time.monotonic()
    assert 0.95 < woke - started < 10  # woken by the landing, not the 30 s bound
    assert d.transfer_results(set()) == (set(), {RID}, set())
    counts = d.stats()["counts"]
    # The wait counted is the one the landing ended: from the call (which a loaded machine may make
    # well after the timer started) to no earlier than the report, and no later than the wake; the
    # slack is for a preemption between this test's clock reads and the call's own.
    slack_us = 100_000
    assert counts["landings_awaited"] == 1
    assert (reported[0] - waiting) * 1e6 - slack_us < counts["landing_wait_us"] <= (woke - waiting) * 1e6 + slack_us


def test_the_wait_is_bounded_and_a_freed_transfer_ends_it_too(worker):
    d = landing_in_flight(worker, 0.05)
    d.hand_off(StepMetadata(no_forward=True))
    started = time.monotonic()
    d.wait_for_landing()  # nothing lands: the bound
    assert time.monotonic() - started >= 0.05
    assert d.transfer_results(set()) == (set(), set(), set())
    counts = d.stats()["counts"]
    assert "landings_awaited" not in counts and counts["landing_wait_us"] >= 50_000
    d.config = d.config.model_copy(update={"landing_wait_s": 30.0})
    report(d, Failed(TID, "lease expired"))
    threading.Timer(0.2, report, (d, Freed(TID, (5, 6)))).start()
    started = time.monotonic()
    d.wait_for_landing()
    assert time.monotonic() - started < 10
    assert d.transfer_results(set()) == (set(), {RID}, {RID})


@pytest.mark.parametrize("case", ["a forward runs", "nothing in flight", "the last step reported", "prefill",
                                  "already landed", "configured off"])
def test_no_wait_where_the_step_computes_or_has_nothing_to_wait_for(worker, case):
    d = landing_in_flight(worker, 0.0 if case == "configured off" else 30.0,
                          push=case != "nothing in flight")
    if case == "the last step reported":
        d.hand_off(StepMetadata(register=[AllocatedBlocks(TransferId("req.2", 0, "abc"), "other", (7,), 0)]))
        report(d, Loaded(TID))
        assert d.transfer_results(set())[1] == {RID}
    if case == "prefill":  # P owes no landings: its worker has no wait at all
        d = worker("prefill")
    if case == "already landed":
        report(d, Loaded(TID))
    d.hand_off(StepMetadata(no_forward=case != "a forward runs"))
    started = time.monotonic()
    d.wait_for_landing()
    assert time.monotonic() - started < 5
    counts = (d.stats() or {}).get("counts", {})
    assert "landings_awaited" not in counts and "landing_wait_us" not in counts


def test_the_landing_wait_is_bounded_in_the_config():
    assert Config().landing_wait_s == 0.002
    with pytest.raises(ValueError, match="landing_wait_s"):
        Config.from_mapping({"landing_wait_s": 1.0})
