"""Failures vLLM's own NIXL connectors' users reported, each run as a scenario on our stack — the real
push writer and receiver, pull lender and reader threads of two ranks, with real side channels, over
the in-memory transport (which can refuse or stall a post as a NIC would) — in push and pull. Each
checks no hang (a bound), no leak (every block back exactly once on each side), no wrong KV and a
live thread. A P restarted under D's registrations needs real processes:
tests/integration/test_upstream_restarts.py."""

from __future__ import annotations

import threading
import time

import pytest

from .test_threads import _register, _until, _warm, ranks, secret  # noqa: F401  (fixtures)

MODES = ["push", "pull"]


def _blocks_back_once(rank, tid, blocks):
    frees = [e for e in rank.events_of("free") if e["tid"] == list(tid)]
    assert len(frees) == 1 and sorted(frees[0]["blocks"]) == sorted(blocks), frees


def _lend_and_read(p, d, tid, p_blocks, d_blocks):
    d.offered(tid=list(tid), offer=p.lend(tid=list(tid), blocks=p_blocks)["offer"])
    d.allocate(tid=list(tid), blocks=d_blocks)


@pytest.mark.parametrize("mode", MODES)
def test_vllm_46283_a_decode_abort_while_loading_returns_its_blocks_once_and_nothing_lands(ranks, mode):
    """vllm-project/vllm#46283: with the push connector D's blocks leaked (or were reused under a
    write) when D aborted a request after registering. Here D aborts while its KV is on the way:
    its blocks go back once, only after P confirmed (push) or the READ ended (pull), and no KV lands
    in them afterwards; P's blocks go back too."""
    p, d = ranks("prefill", "--mode", mode), ranks("decode", "--mode", mode, "--watchdog-s", "20")
    tid = ("aborted", 0)
    before = d.digest(blocks=[4, 5])["digest"]
    p.fill(blocks=[2, 3], seed=7)
    if mode == "push":
        _register(d, p, tid, [4, 5])
        time.sleep(0.2)  # the registration is at P
        d.abort(tid=list(tid), reason="client went away")
        _until(lambda: d.events_of("free"), "D's blocks never came back")
        p.kv_ready(tid=list(tid), blocks=[2, 3])  # the prefill ends after the abort
    else:
        _warm_read(p, d)
        d.peer.transport.stall_posts_to.add(p.peer.agent)  # the READ is in flight
        _lend_and_read(p, d, tid, [2, 3], [4, 5])
        _until(lambda: d.peer.thread.reads, "the READ never started")
        d.abort(tid=list(tid), reason="client went away")
        time.sleep(0.3)
        assert not [e for e in d.events_of("free") if e["tid"] == list(tid)], "freed under a READ in flight"
        d.peer.transport.land_stalled()
    p.wait("free", tid, timeout=10)
    d.wait("free", tid, timeout=10)
    time.sleep(0.3)  # anything late would have landed by now
    _blocks_back_once(d, tid, [4, 5])
    _blocks_back_once(p, tid, [2, 3])
    if mode == "push":
        assert d.digest(blocks=[4, 5])["digest"] == before  # P wrote nothing into the aborted blocks
    assert not [e for e in d.events_of("loaded") if e["tid"] == list(tid)]
    assert p.stats()["outstanding_blocks"] == d.stats()["outstanding_blocks"] == 0
    assert d.peer.thread._thread.is_alive() and p.peer.thread._thread.is_alive()


def _warm_read(p, d):
    warm = ("warm-read", 0)
    _lend_and_read(p, d, warm, [1], [1])
    d.wait("loaded", warm)


@pytest.mark.parametrize("mode", MODES)
def test_vllm_50754_a_transfer_that_fails_to_post_fails_at_once_instead_of_hanging(ranks, mode):
    """vllm-project/vllm#50754 (tracking #48633): D waited forever for a notification when P's WRITE
    failed to post. Here the post fails: D learns why at once — long before its 20 s watchdog —
    and both sides' blocks go back once; the next transfer between them lands."""
    p, d = ranks("prefill", "--mode", mode, "--lease-s", "20"), ranks("decode", "--mode", mode, "--watchdog-s", "20")
    tid = ("unposted", 0)
    started = time.monotonic()
    if mode == "push":
        p.peer.transport.fail_posts_to.add(d.peer.agent)
        _register(d, p, tid, [4, 5])
        time.sleep(0.2)
        p.kv_ready(tid=list(tid), blocks=[2, 3])
    else:
        d.peer.transport.fail_posts_to.add(p.peer.agent)
        _lend_and_read(p, d, tid, [2, 3], [4, 5])
    assert d.wait("failed", tid, timeout=10)["reason"]
    d.wait("free", tid, timeout=10)
    p.wait("free", tid, timeout=10)  # P is told, not left to its 20 s lease
    assert time.monotonic() - started < 10
    _blocks_back_once(d, tid, [4, 5])
    _blocks_back_once(p, tid, [2, 3])
    (p.peer.transport if mode == "push" else d.peer.transport).fail_posts_to.clear()
    after = ("after", 0)
    p.fill(blocks=[6, 7], seed=9)
    if mode == "push":
        _register(d, p, after, [8, 9])
        p.kv_ready(tid=list(after), blocks=[6, 7])
    else:
        _lend_and_read(p, d, after, [6, 7], [8, 9])
    d.wait("loaded", after)
    assert d.digest(blocks=[8, 9]) == p.digest(blocks=[6, 7])


@pytest.mark.parametrize("mode", MODES)
def test_vllm_58222_held_kv_whose_lease_ran_out_is_freed_in_time_under_churn(ranks, mode):
    """vllm-project/vllm#58222: the lease reaper stopped at the first live entry, so expired blocks
    behind it stayed held. Here 24 transfers come and go at once, half of them never taken by a D:
    every one of those goes back within its lease and a tick, whichever were taken around it."""
    lease_s = 0.5
    p = ranks("prefill", "--mode", mode, "--lease-s", str(lease_s), "--max-write-s", "0.5")
    d = ranks("decode", "--mode", mode, "--watchdog-s", "20")
    if mode == "push":
        _warm(p, d, [1])
    else:
        _warm_read(p, d)
    handed: dict[tuple, tuple[float, list[int]]] = {}
    for i in range(24):
        tid, taken = (f"churn-{i}", 0), i % 2 == 0
        src, dst = [10 + 2 * i, 11 + 2 * i], [60 + 2 * i, 61 + 2 * i]
        if mode == "push":
            if taken:
                _register(d, p, tid, dst)
            p.kv_ready(tid=list(tid), blocks=src)
        else:
            offer = p.lend(tid=list(tid), blocks=src)["offer"]
            if taken:
                d.offered(tid=list(tid), offer=offer)
                d.allocate(tid=list(tid), blocks=dst)
        handed[tid] = (time.monotonic(), src)
    # The rule (no lapsed lease waits behind a live one) is the core's, tested with its own clock in
    # tests/protocol; here, through real threads, each is freed for its lease, within a bound far
    # below D's watchdog (20 s), whatever the machine's load: a loan lasts its lease plus a READ's
    # grace (max_read_s) and the skew allowance, the writer's lease ends at its next tick.
    bound = lease_s + (0.5 + 0.2 if mode == "pull" else 0) + 5.0
    for i, (tid, (at, src)) in enumerate(handed.items()):
        freed = p.wait("free", tid, timeout=10)
        if i % 2:  # never taken
            assert freed["seen_at"] - at < bound, f"{tid} held {freed['seen_at'] - at:.2f} s, lease {lease_s} s"
            assert not [e for e in d.events_of("loaded") if e["tid"] == list(tid)]
        else:
            d.wait("loaded", tid)
        _blocks_back_once(p, tid, src)
    assert p.stats()["live"] == 0 and p.stats()["outstanding_blocks"] == 0


@pytest.mark.slow  # waits out each fence: about 4 s a case
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", ["refused", "silent"])
def test_a_prefill_gone_mid_transfer_lets_the_request_go_on_in_seconds_and_its_blocks_wait_for_their_fence(
        ranks, mode, fault):
    """P dies (its side channel refuses D's probes) or stops (it answers none) while D waits on it:
    before, D waited out its watchdog and then its fence (push) or a READ's deadline twice (pull)
    before the request could go on. Now the load fails within suspect_after_s and a probe, while
    the blocks stay D's until their fence, since a P that was only stopped may still write."""
    # suspect_s leaves a live P's side-channel thread room to answer while both cores are busy
    # with the suite's other worker (0.6 s was once not enough); the watchdog stays well after it.
    suspect_s, watchdog_s, max_write_s = 1.2, 5.0, 1.0 if mode == "push" else 2.0
    # P's own registration watchdog outlasts D's fence: a P that gives up tells D, which may then free early.
    p = ranks("prefill", "--mode", mode, "--lease-s", "20", "--watchdog-s", "20")
    d = ranks("decode", "--mode", mode, "--watchdog-s", str(watchdog_s), "--max-write-s", str(max_write_s),
              "--suspect-after-s", str(suspect_s))
    tid = ("p-gone", 0)
    if mode == "push":
        _register(d, p, tid, [4, 5])
        registered = time.monotonic()
    else:
        _warm_read(p, d)
        d.peer.transport.stall_posts_to.add(p.peer.agent)  # the READ is in flight when P goes
        _lend_and_read(p, d, tid, [2, 3], [4, 5])
        _until(lambda: d.peer.thread.reads, "the READ never started")
        registered = time.monotonic()
    time.sleep(suspect_s + 0.2)  # P answers D's probes meanwhile: a live P is never suspected
    assert not d.events_of("quarantined") and not d.events_of("failed")
    release = threading.Event()
    if fault == "refused":
        p.peer.server.close()
    else:  # its side-channel thread stops answering, as a SIGSTOPped process's would
        p.peer.server.on_message = lambda message: release.wait(30)
    try:
        quarantined = d.wait("quarantined", tid, timeout=watchdog_s)
        # The reason says the probe decided, not D's watchdog (which would have named watchdog_s).
        assert ("unreachable" if fault == "refused" else "silent") in quarantined["reason"], quarantined
        freed = d.wait("free", tid, timeout=watchdog_s + 3 * max_write_s + 2)
        # push: not before the registration expired, when P (alive here, only cut off) says it wrote
        # nothing, else its fence; pull: the READ's deadline (max_read_s after its post) and as long again.
        kept = (registered + watchdog_s) if mode == "push" else (registered + 2 * max_write_s)
        assert freed["seen_at"] >= kept - 0.3, f"freed {kept - freed['seen_at']:.2f} s too early"
    finally:
        release.set()
    _blocks_back_once(d, tid, [4, 5])
    assert not [e for e in d.events_of("loaded") if e["tid"] == list(tid)]
    assert d.peer.thread._thread.is_alive()
