"""Faults between real P and D processes: kill -9, forged and out-of-bounds registrations, a
restarted D. Each test starts the processes it kills."""

import time

import pytest

from neuron_disagg.protocol import RankRegions, Registration, TransferId
from neuron_disagg.protocol.geometry import rank_regions
from neuron_disagg.testing.peer import SHAPE

from neuron_disagg.testing.peer_process import SECRET

from .fabrics import peers_on

pytestmark = pytest.mark.integration
WATCHDOG_S, MAX_WRITE_S, SKEW_S = 4.0, 1.0, 0.2  # room for a loaded machine: a probe decides first


@pytest.fixture
def procs(fabric):
    with peers_on(fabric) as start:
        yield start


def _decode(procs, *extra):
    return procs("decode", "--watchdog-s", str(WATCHDOG_S), "--max-write-s", str(MAX_WRITE_S), *extra)


def _deliver(p, d, tid, p_blocks, d_blocks, seed):
    p.call("fill", blocks=p_blocks, seed=seed)
    d.call("expect", tid=tid, p_address=p.address)
    d.call("allocate", tid=tid, blocks=d_blocks)
    p.call("kv_ready", tid=tid, blocks=p_blocks)
    d.event_for("loaded", tid)
    assert d.call("digest", blocks=d_blocks)["digest"] == p.call("digest", blocks=p_blocks)["digest"]


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_decode_killed_prefill_fails_frees_and_serves_a_restarted_decode(procs, fabric):
    p = procs("prefill", "--lease-s", "30")
    d = _decode(procs, "--watchdog-s", "30")  # D's registration outlives the kill and P's kv_ready
    _deliver(p, d, ["warm", 0], [1, 2], [3, 4], seed=1)  # P now holds D's agent
    tid = ["doomed", 0]
    d.call("expect", tid=tid, p_address=p.address)
    d.call("allocate", tid=tid, blocks=[5, 6, 7])
    _wait(lambda: p.call("stats")["live"] == 1)  # P has the registration
    port = d.address.rsplit(":", 1)[1]
    d.kill()
    p.call("fill", blocks=[8, 9, 10], seed=2)
    p.call("kv_ready", tid=tid, blocks=[8, 9, 10])
    freed = p.event_for("free", tid, timeout=20)  # before the 30 s lease (once, under load, it took over 10 s)
    assert sorted(freed["blocks"]) == [8, 9, 10]
    assert p.call("stats")["writer"].get("write_failed", 0) == 1
    # D comes back on the same port with a new agent; P recovers without a restart.
    d2 = _decode(procs, "--port", port)
    assert d2.agent != d.agent
    _deliver(p, d2, ["after-restart", 0], [11, 12], [13, 14], seed=3)
    stats = p.call("stats")
    assert stats["outstanding_blocks"] == 0
    # Measured with nixl 1.4.1's LIBFABRIC plugin (tcp provider): after a WRITE to a dead peer the
    # agent re-reads the error on rail 0's completion queue and never posts again, so P replaces
    # its agent; UCX recovers by forgetting the dead peer alone.
    resets = 1 if fabric.backend == "LIBFABRIC" else 0
    assert stats["writer"].get("agent_resets", 0) == resets
    assert stats["initiator"] == (f"{p.agent}-writer.1" if resets else f"{p.agent}-writer")


def test_prefill_killed_under_a_registration_lets_decode_go_on_at_once_and_frees_at_the_fence(procs):
    """kill -9 of P holding D's registration: D's next probe is refused, so the load is given up
    within a probe's interval (suspect_after_s / 3), not at D's watchdog; the blocks, which a P
    only paused could still write, come back at the fence."""
    p = procs("prefill")
    d = _decode(procs, "--suspect-after-s", "1.2")  # room for a busy machine; a kill is seen by the next probe
    tid = ["orphan", 0]
    d.call("expect", tid=tid, p_address=p.address)
    started = time.monotonic()
    d.call("allocate", tid=tid, blocks=[20, 21])
    _wait(lambda: p.call("stats")["live"] == 1)
    p.kill()
    quarantined = d.event_for("quarantined", tid, timeout=15)
    freed = d.event_for("free", tid, timeout=15)
    elapsed = time.monotonic() - started
    assert "unreachable" in quarantined["reason"], quarantined  # a probe decided, not the watchdog
    assert sorted(freed["blocks"]) == [20, 21]
    bound = WATCHDOG_S + 2 * MAX_WRITE_S + SKEW_S  # the registration's expiry, then its fence
    assert WATCHDOG_S <= elapsed < bound + 10.0, f"D freed after {elapsed:.1f} s, fence {bound} s"  # held to the fence; then a hang guard
    assert d.call("stats")["outstanding_blocks"] == 0


def test_forged_and_out_of_bounds_registrations_are_rejected_before_any_write(procs, fabric):
    p = procs("prefill")
    d = _decode(procs)
    regions = rank_regions(SHAPE, 128, base_addr=1 << 44)  # nowhere near D's real memory
    forged = Registration(TransferId("forged"), d.agent, "x", d.address, 1,
                          (RankRegions(0, d.agent, regions),), (1, 2), 0, time.time() + 30)
    fabric.send(p.address, b"not-the-deployment-secret-at-all", forged)
    _wait(lambda: p.call("stats")["rejected"].get("bad_signature", 0) == 1)
    assert p.call("stats")["live"] == 0

    # Correctly signed, but pointing outside what D registered: refused before posting.
    oob = Registration(TransferId("oob"), d.agent, "x", d.address, 1,
                       (RankRegions(0, d.agent, regions),), (1, 2), 0, time.time() + 30)
    fabric.send(p.address, SECRET.encode(), oob)
    _wait(lambda: p.call("stats")["live"] == 1)
    p.call("fill", blocks=[30, 31], seed=4)
    p.call("kv_ready", tid=["oob", 0], blocks=[30, 31])
    assert sorted(p.event_for("free", ["oob", 0])["blocks"]) == [30, 31]
    stats = p.call("stats")
    assert stats["writer"].get("registration_rejected") == 1
    assert stats["writer"].get("bytes", 0) == 0


def test_prefill_killed_before_the_read_decode_fails_and_reads_from_a_new_prefill(procs, fabric):
    def lend(p, tid, blocks, seed):
        p.call("fill", blocks=blocks, seed=seed)
        return p.call("lend", tid=tid, blocks=blocks)["offer"]

    def read(d, tid, offer, blocks):
        d.call("offered", tid=tid, offer=offer)
        d.call("allocate", tid=tid, blocks=blocks)

    p = procs("prefill", "--mode", "pull", "--lease-s", "30")
    d = procs("decode", "--mode", "pull", "--max-write-s", str(MAX_WRITE_S))
    read(d, ["warm", 0], lend(p, ["warm", 0], [1, 2], seed=1), [3, 4])
    d.event_for("loaded", ["warm", 0])  # D's reader now holds P's agent
    doomed = lend(p, ["doomed", 0], [5, 6], seed=2)
    p.kill()
    read(d, ["doomed", 0], doomed, [7, 8])
    assert d.event_for("failed", ["doomed", 0], timeout=10)["reason"]
    assert sorted(d.event_for("free", ["doomed", 0], timeout=10)["blocks"]) == [7, 8]

    p2 = procs("prefill", "--mode", "pull", "--lease-s", "30")
    read(d, ["after", 0], lend(p2, ["after", 0], [9, 10], seed=3), [11, 12])
    d.event_for("loaded", ["after", 0])
    assert d.call("digest", blocks=[11, 12])["digest"] == p2.call("digest", blocks=[9, 10])["digest"]
    resets = 1 if fabric.backend == "LIBFABRIC" else 0  # see the push test above
    assert d.call("stats")["writer"].get("agent_resets", 0) == resets
