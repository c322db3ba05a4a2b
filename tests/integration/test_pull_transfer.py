"""Pull mode between real P and D processes over NIXL (UCX, and LIBFABRIC in a namespace; see
fabrics.py): D READs from P off its engine loop."""

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pull_pair(fabric):
    # A READ may take 2 s (the first one also makes NIXL's connection, slow on a loaded machine).
    p = fabric.peer("prefill", "--mode", "pull", "--lease-s", "5", "--max-write-s", "2")
    d = fabric.peer("decode", "--mode", "pull", "--max-write-s", "2")
    yield p, d
    p.stop()
    d.stop()


def _pull(p, d, tid, p_blocks, d_blocks, seed, first=0):
    p.call("fill", blocks=p_blocks, seed=seed)
    offer = p.call("lend", tid=tid, blocks=p_blocks)["offer"]
    d.call("offered", tid=tid, offer=offer)
    d.call("allocate", tid=tid, blocks=d_blocks[first:], first=first)


def test_read_lands_exactly_and_p_frees_on_read_done(pull_pair):
    p, d = pull_pair
    tid = ["pull-1", 0]
    _pull(p, d, tid, [3, 4, 5, 8], [30, 31, 32, 33], seed=11)
    d.event_for("loaded", tid)
    assert sorted(p.event_for("free", tid, timeout=5)["blocks"]) == [3, 4, 5, 8]
    assert d.call("digest", blocks=[30, 31, 32, 33])["digest"] == p.call("digest", blocks=[3, 4, 5, 8])["digest"]


def test_many_pulls_in_flight_with_a_prefix_hit(pull_pair):
    p, d = pull_pair
    tids = [[f"pull-many-{i}", 0] for i in range(16)]
    for i, tid in enumerate(tids):
        _pull(p, d, tid, [40 + 2 * i, 41 + 2 * i], [80 + 2 * i, 81 + 2 * i], seed=200 + i, first=i % 2)
    for i, tid in enumerate(tids):
        d.event_for("loaded", tid)
        p.event_for("free", tid, timeout=5)
        first = i % 2
        want = p.call("digest", blocks=[40 + 2 * i, 41 + 2 * i][first:])["digest"]
        assert d.call("digest", blocks=[80 + 2 * i, 81 + 2 * i][first:])["digest"] == want


def test_offer_that_nobody_reads_is_freed_when_the_lease_ends(pull_pair):
    p, d = pull_pair
    tid = ["unread", 0]
    p.call("fill", blocks=[100], seed=1)
    p.call("lend", tid=tid, blocks=[100])
    assert p.event_for("free", tid, timeout=5 + 2 + 0.2 + 3)["blocks"] == [100]


def test_decode_gives_up_before_allocating_and_p_frees_early(pull_pair):
    p, d = pull_pair
    tid = ["pull-abort", 0]
    p.call("fill", blocks=[110], seed=2)
    offer = p.call("lend", tid=tid, blocks=[110])["offer"]
    d.call("offered", tid=tid, offer=offer)
    d.call("abort", tid=tid, reason="client disconnected")
    assert p.event_for("free", tid, timeout=5)["blocks"] == [110]  # ReadFailed, before the 7.2 s lease


def test_pull_blocks_are_back(pull_pair):
    for peer in pull_pair:
        stats = peer.call("stats")
        assert stats["outstanding_blocks"] == 0 and stats["live"] == 0, stats
