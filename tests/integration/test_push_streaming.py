"""Streamed push between real rank processes over NIXL (UCX and LIBFABRIC): the finished chunks of a
prefill land in D's blocks while it runs, D hears of the transfer once, when every byte has landed,
and the faults that can strike mid-stream — P preempted (its blocks reused under a write), P killed
after some chunks, one P rank of two far ahead of the other — end with no wrong byte decoded and
every block back."""

import time

import pytest

from neuron_disagg.local_cluster import free_port

from .fabrics import peers_on

pytestmark = pytest.mark.integration
WATCHDOG_S, MAX_WRITE_S, SKEW_S, SUSPECT_S = 6.0, 3.0, 0.2, 1.2  # room for a loaded machine: a probe decides first
BOUND_S = WATCHDOG_S + 2 * MAX_WRITE_S + SKEW_S  # D's watchdog, then its fence (as in test_push_faults)
# Where no watchdog is under test: one no stall of a loaded machine outlasts (the peers' default is 3 s)
PATIENT = ("--watchdog-s", "20")


@pytest.fixture
def procs(fabric):
    with peers_on(fabric) as start:
        yield start


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _landed(p, p_blocks, d, d_blocks) -> bool:
    return d.call("digest", blocks=d_blocks)["digest"] == p.call("digest", blocks=p_blocks)["digest"]


def _loads(d, tid) -> list:
    return [e for e in d.events if e["event"] in ("loaded", "failed") and e["tid"] == list(tid)]


def test_each_chunk_lands_while_the_prefill_runs_and_decode_hears_of_the_transfer_once(procs):
    p, d = procs("prefill", *PATIENT), procs("decode", *PATIENT)
    tid, p_blocks, d_blocks = ["streamed", 0], [7, 3, 9, 1, 5, 2], [40, 41, 12, 13, 30, 31]
    p.call("fill", blocks=p_blocks, seed=11)
    d.call("expect", tid=tid, p_address=p.address)
    d.call("allocate", tid=tid, blocks=d_blocks)
    _wait(lambda: p.call("stats")["live"] == 1)  # P has the registration
    p.call("kv_chunk", tid=tid, blocks=p_blocks[:2])
    _wait(lambda: _landed(p, p_blocks[:2], d, d_blocks[:2]))  # before the prefill ends
    p.call("kv_chunk", tid=tid, blocks=p_blocks[:4])
    _wait(lambda: _landed(p, p_blocks[:4], d, d_blocks[:4]))
    assert not _loads(d, tid)  # D decodes nothing yet: it has heard nothing
    p.call("kv_ready", tid=tid, blocks=p_blocks)
    d.event_for("loaded", tid)
    assert _landed(p, p_blocks, d, d_blocks)
    assert sorted(p.event_for("free", tid)["blocks"]) == sorted(p_blocks)
    stats = p.call("stats")
    assert stats["writer"]["chunk_writes"] == 2 and stats["writer"]["writes"] == 1
    assert stats["outstanding_blocks"] == 0 and stats["live"] == 0
    time.sleep(0.3)
    assert len(_loads(d, tid)) == 1
    assert not d.call("stats")["notifications_rejected"]  # a chunk's WRITE carries no notification at all


def test_a_registration_after_chunks_finished_takes_the_backlog_in_one_write(procs):
    p, d = procs("prefill", *PATIENT), procs("decode", *PATIENT)
    tid, p_blocks, d_blocks = ["backlog", 0], [1, 2, 3, 4], [20, 21, 22, 23]
    p.call("fill", blocks=p_blocks, seed=12)
    p.call("kv_chunk", tid=tid, blocks=p_blocks[:1])
    p.call("kv_chunk", tid=tid, blocks=p_blocks[:3])  # D chosen late: three blocks finished already
    d.call("expect", tid=tid, p_address=p.address)
    d.call("allocate", tid=tid, blocks=d_blocks)
    _wait(lambda: _landed(p, p_blocks[:3], d, d_blocks[:3]))
    assert p.call("stats")["writer"]["chunk_writes"] == 1
    p.call("kv_ready", tid=tid, blocks=p_blocks)
    d.event_for("loaded", tid)
    assert _landed(p, p_blocks, d, d_blocks)


def test_a_prefill_preempted_mid_stream_is_written_again_from_its_new_blocks(procs):
    p, d = procs("prefill", *PATIENT), procs("decode", *PATIENT)
    tid, d_blocks = ["preempted", 0], [50, 51, 52, 53]
    d.call("expect", tid=tid, p_address=p.address)
    d.call("allocate", tid=tid, blocks=d_blocks)
    _wait(lambda: p.call("stats")["live"] == 1)
    p.call("fill", blocks=[1, 2, 3, 4], seed=13)
    p.call("kv_chunk", tid=tid, blocks=[1, 2])
    _wait(lambda: _landed(p, [1, 2], d, d_blocks[:2]))
    p.call("preempted", tid=tid)  # vLLM gave blocks 1 and 2 to another request
    p.call("fill", blocks=[1, 2], seed=99)  # ...which overwrote them
    again = [8, 9, 10, 11]
    p.call("fill", blocks=again, seed=13)  # computed again, in other blocks
    p.call("kv_ready", tid=tid, blocks=again)
    d.event_for("loaded", tid)
    assert _landed(p, again, d, d_blocks)
    counters = p.call("stats")["counters"]
    assert counters["stream_rewritten"] == 1


def test_prefill_killed_after_some_chunks_lets_decode_go_on_at_once_and_frees_at_the_fence(procs):
    p = procs("prefill")
    d = procs("decode", "--watchdog-s", str(WATCHDOG_S), "--max-write-s", str(MAX_WRITE_S),
              "--suspect-after-s", str(SUSPECT_S))
    tid, p_blocks, d_blocks = ["killed-mid-stream", 0], [1, 2, 3, 4], [60, 61, 62, 63]
    p.call("fill", blocks=p_blocks, seed=14)
    d.call("expect", tid=tid, p_address=p.address)
    started = time.monotonic()
    d.call("allocate", tid=tid, blocks=d_blocks)
    _wait(lambda: p.call("stats")["live"] == 1)
    p.call("kv_chunk", tid=tid, blocks=p_blocks[:2])
    _wait(lambda: _landed(p, p_blocks[:2], d, d_blocks[:2]))  # two of four chunks landed
    p.kill()
    quarantined = d.event_for("quarantined", tid, timeout=BOUND_S + 10)
    assert "unreachable" in quarantined["reason"], quarantined  # a probe decided, not the watchdog
    assert sorted(d.event_for("free", tid, timeout=BOUND_S + 10)["blocks"]) == d_blocks
    assert time.monotonic() - started < BOUND_S + 10  # a hang guard; the reason says what decided
    assert not [e for e in d.events if e["event"] == "loaded" and e["tid"] == tid]
    assert d.call("stats")["outstanding_blocks"] == 0


def test_one_prefill_rank_far_ahead_of_the_other_loads_only_when_both_have_landed(fabric):
    with peers_on(fabric) as start:
        p_port = free_port()
        ps = [start("prefill", "--port", str(p_port), "--tp-rank", str(r), "--tp-size", "2", *PATIENT) for r in range(2)]
        d = start("decode", *PATIENT)
        tid, p_blocks, d_blocks = ["ranks-apart", 0], [1, 2, 3, 4], [70, 71, 72, 73]
        for r, p in enumerate(ps):
            p.call("fill", blocks=p_blocks, seed=300 + r)
        d.call("expect", tid=tid, p_address=ps[0].address, p_tp=2)
        d.call("allocate", tid=tid, blocks=d_blocks)
        for p in ps:
            _wait(lambda: p.call("stats")["live"] == 1)
        ps[0].call("kv_chunk", tid=tid, blocks=p_blocks[:2])
        ps[0].call("kv_ready", tid=tid, blocks=p_blocks)  # rank 0 is done
        assert sorted(ps[0].event_for("free", tid)["blocks"]) == p_blocks
        ps[1].call("kv_chunk", tid=tid, blocks=p_blocks[:1])  # rank 1 is one chunk in
        time.sleep(0.5)
        assert not _loads(d, tid)  # half the heads landed: no load yet
        ps[1].call("kv_chunk", tid=tid, blocks=p_blocks[:3])
        ps[1].call("kv_ready", tid=tid, blocks=p_blocks)
        d.event_for("loaded", tid)
        # Each P rank wrote its half of the heads (HND: a block's heads one after another), so
        # each of D's blocks is the two ranks' blocks end to end, in every region.
        rows = [[p.call("read", block=b)["regions"] for b in p_blocks] for p in ps]
        got = [d.call("read", block=b)["regions"] for b in d_blocks]
        for i in range(len(p_blocks)):
            assert got[i] == [a + b for a, b in zip(rows[0][i], rows[1][i], strict=True)], f"block {d_blocks[i]}"
        assert all(p.call("stats")["outstanding_blocks"] == 0 for p in ps)


def test_a_last_write_with_nothing_left_to_move_still_tells_every_decode_rank(fabric):
    """Every block went as chunks before the prefill ended, so the last write moves nothing and its
    notification goes alone, over the side channel: to every D rank this P rank wrote into (D at TP
    2), not to rank 0 alone, whose sibling would wait out its watchdog (20 s here, inside the 30 s wait)."""
    with peers_on(fabric) as start:
        p = start("prefill", *PATIENT)
        d_port = free_port()
        ds = [start("decode", "--port", str(d_port), "--tp-rank", str(r), "--tp-size", "2", *PATIENT) for r in range(2)]
        tid, p_blocks, d_blocks = ["notice-only", 0], [5, 6], [20, 21]
        p.call("fill", blocks=p_blocks, seed=41)
        for d in ds:
            d.call("expect", tid=tid, p_address=p.address)
            d.call("allocate", tid=tid, blocks=d_blocks)
        _wait(lambda: p.call("stats")["live"] == 1)
        p.call("kv_chunk", tid=tid, blocks=p_blocks)
        _wait(lambda: p.call("stats")["writer"].get("chunk_writes", 0) == 1)
        p.call("kv_ready", tid=tid, blocks=p_blocks)
        for d in ds:  # the load ends either way: loaded, or failed at the watchdog if never told
            _wait(lambda: _loads(d, tid), timeout=30)
            assert [e["event"] for e in _loads(d, tid)] == ["loaded"], _loads(d, tid)
        assert sorted(p.event_for("free", tid)["blocks"]) == p_blocks
