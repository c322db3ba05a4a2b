"""A transfer's WRITEs to several peer ranks (D at TP 2): when one part fails while another is
still landing, the failure is reported only once every posted part has ended, since the owner then
tells D, which frees blocks the other part may still be writing into (I2)."""

from collections import Counter
from types import SimpleNamespace

import numpy as np

from neuron_disagg.protocol.messages import TransferId
from neuron_disagg.protocol.plan import RankWrite
from neuron_disagg.transfer.inflight import InFlight, Part
from neuron_disagg.transfer.transport import InMemoryTransport, MemorySpan

TID = TransferId("two-parts")


def _agent(name, buffer):
    agent = InMemoryTransport(name)
    agent.spans.append(MemorySpan(buffer.ctypes.data, buffer.nbytes))
    return agent


def _part(d_rank, agent, src, dst) -> Part:
    u64 = lambda a: np.array([a.ctypes.data], dtype=np.uint64)  # noqa: E731
    write = RankWrite(d_rank, agent.name, u64(src), u64(dst), np.array([src.nbytes], dtype=np.uint64),
                      np.zeros(1, np.int64), np.zeros(1, np.int64), 1)
    return Part("d:1", d_rank, write)


def _setup(tag):
    p_mem, d0_mem, d1_mem = (np.full(64, 7, np.uint8), np.zeros(64, np.uint8), np.zeros(64, np.uint8))
    p, d0, d1 = _agent(f"p-{tag}", p_mem), _agent(f"d0-{tag}", d0_mem), _agent(f"d1-{tag}", d1_mem)
    for d in (d0, d1):
        p.add_peer(d.metadata())
    peers = SimpleNamespace(spans={}, handshake=lambda *a: None, handshake_finished=lambda a: None)
    writes = InFlight(p, peers, lambda agent, error: None, Counter())
    parts = [_part(0, d0, p_mem, d0_mem), _part(1, d1, p_mem, d1_mem)]
    return p, d0, d1, writes, parts, (p_mem, d0_mem, d1_mem)


def test_a_part_that_fails_to_post_is_reported_only_once_the_part_already_posted_has_landed():
    p, d0, d1, writes, parts, (p_mem, d0_mem, _) = _setup("post")
    p.stall_posts_to.add(d0.name)  # rank 0's part is posted and stays in flight
    p.fail_posts_to.add(d1.name)   # rank 1's part cannot be posted
    assert writes.submit(TID, "WRITE", parts, b"") is None  # not failed yet: a part is landing
    assert writes.poll() == ([], []) and writes.tids() == [TID]
    assert p.land_stalled() == 1  # the RDMA op in flight ends
    assert np.array_equal(d0_mem, p_mem)
    done, failed = writes.poll()
    assert not done and failed == [(TID, f"peer {d1.name} is not reachable")] and not writes.tids()


def test_a_part_that_fails_alone_fails_the_transfer_at_once():
    p, d0, d1, writes, parts, _ = _setup("alone")
    p.fail_posts_to.add(d0.name)
    assert writes.submit(TID, "WRITE", parts, b"") == f"peer {d0.name} is not reachable"
    assert not writes.tids()


def _gated(part, gate) -> Part:
    return Part(part.peer_address, part.peer_rank, part.plan, gate)


def test_a_gated_part_is_posted_once_its_gate_opens_and_the_write_ends_only_after_it():
    """Streaming by layers: a part whose layers the forward has not written yet waits; posting it
    at once (the gate ignored) would read KV still being computed."""
    p, d0, d1, writes, parts, (p_mem, d0_mem, d1_mem) = _setup("gate")
    opened = []
    gated = [parts[0], _gated(parts[1], lambda: bool(opened))]
    assert writes.submit(TID, "WRITE", gated, b"frame") is None
    for _ in range(3):
        assert writes.poll() == ([], [])  # rank 0's part landed; rank 1's waits on its layers
    assert np.array_equal(d0_mem, p_mem) and not d1_mem.any()
    opened.append(True)
    done, failed = writes.poll()
    assert done == [TID] and not failed and np.array_equal(d1_mem, p_mem)


def test_a_part_that_fails_while_another_waits_on_its_gate_fails_the_write_and_never_posts_the_other():
    p, d0, d1, writes, parts, (_, _, d1_mem) = _setup("gate-fail")
    p.fail_posts_to.add(d0.name)
    opened = []
    gated = [parts[0], _gated(parts[1], lambda: bool(opened))]
    assert writes.submit(TID, "WRITE", gated, b"") == f"peer {d0.name} is not reachable"
    assert not writes.tids()
    opened.append(True)  # its layers ran after the write had failed: nothing is posted for it
    assert writes.poll() == ([], []) and not d1_mem.any()
