"""Push transfers between real P and D processes over NIXL (DRAM), once over UCX on 127.0.0.1 and
once over LIBFABRIC's tcp provider in a private network namespace (see fabrics.py)."""

import time

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(fabric):
    # Watchdogs far beyond what any test here waits for: 24 registrations and their writes must fit
    # inside the first one's on a loaded machine.
    p = fabric.peer("prefill", "--lease-s", "5", "--watchdog-s", "20")
    d = fabric.peer("decode", "--watchdog-s", "20", "--max-write-s", "2")
    assert p.backends == d.backends == [fabric.backend]  # the agents run on that backend alone
    yield p, d
    p.stop()
    d.stop()


def _transfer(p, d, tid, p_blocks, d_blocks, seed, registration_first=True, first=0):
    p.call("fill", blocks=p_blocks, seed=seed)
    d.call("expect", tid=tid, p_address=p.address)
    if registration_first:
        d.call("allocate", tid=tid, blocks=d_blocks[first:], first=first)
        p.call("kv_ready", tid=tid, blocks=p_blocks)
    else:
        p.call("kv_ready", tid=tid, blocks=p_blocks)
        d.call("allocate", tid=tid, blocks=d_blocks[first:], first=first)


def _assert_delivered(p, d, tid, p_blocks, d_blocks, first=0):
    d.event_for("loaded", tid)
    freed = p.event_for("free", tid)
    assert sorted(freed["blocks"]) == sorted(p_blocks)
    want = p.call("digest", blocks=p_blocks[first:])["digest"]
    got = d.call("digest", blocks=d_blocks[first:])["digest"]
    assert got == want, "bytes on D differ from P's KV"


@pytest.mark.parametrize("registration_first", [True, False], ids=["registration-first", "kv-first"])
def test_bytes_land_exactly_in_either_order(pair, registration_first):
    p, d = pair
    tid = [f"order-{registration_first}", 0]
    p_blocks, d_blocks = [3, 4, 5, 9, 10], [20, 21, 22, 23, 40]
    _transfer(p, d, tid, p_blocks, d_blocks, seed=7, registration_first=registration_first)
    _assert_delivered(p, d, tid, p_blocks, d_blocks)


@pytest.mark.parametrize("announced", ["the same blocks", "other blocks"])
def test_a_write_planned_during_the_last_forward_lands_exactly(pair, announced):
    """P's engine names the blocks before the forward that fills them (kv_coming), after D's
    registration arrived: the writer plans then, and builds NIXL's request for the write, which
    after the forward is only posted. Named wrongly, neither plan nor request may be used."""
    p, d = pair
    warm = [f"warm-for-{announced}", 0]  # P's agent must know D's to build a request for it
    _transfer(p, d, warm, [1], [1], seed=4)
    _assert_delivered(p, d, warm, [1], [1])
    tid = [f"announced-{announced}", 0]
    p_blocks, d_blocks = [11, 12, 13], [30, 31, 32]
    posted_as_built = p.call("stats")["writer"].get("prepared_posted", 0)
    p.call("fill", blocks=p_blocks, seed=5)
    live = p.call("stats")["live"]
    d.call("expect", tid=tid, p_address=p.address)
    d.call("allocate", tid=tid, blocks=d_blocks)
    deadline = time.monotonic() + 5
    while p.call("stats")["live"] == live:  # until D's registration reached P
        assert time.monotonic() < deadline, "D's registration never reached P"
        time.sleep(0.01)
    p.call("kv_coming", tid=tid, blocks=p_blocks if announced == "the same blocks" else [14, 15, 16])
    p.call("kv_ready", tid=tid, blocks=p_blocks)
    _assert_delivered(p, d, tid, p_blocks, d_blocks)
    built = p.call("stats")["writer"].get("prepared_posted", 0) - posted_as_built
    assert built == (1 if announced == "the same blocks" else 0)


def test_prefix_hit_writes_only_the_tail(pair):
    p, d = pair
    tid = ["prefix", 0]
    p_blocks, d_blocks = [50, 51, 52, 53], [60, 61, 62, 63]
    d.call("fill", blocks=d_blocks[:2], seed=99)  # D's cached prefix must stay untouched
    before = d.call("digest", blocks=d_blocks[:2])["digest"]
    _transfer(p, d, tid, p_blocks, d_blocks, seed=8, first=2)
    _assert_delivered(p, d, tid, p_blocks, d_blocks, first=2)
    assert d.call("digest", blocks=d_blocks[:2])["digest"] == before


def test_many_requests_in_flight(pair):
    p, d = pair
    tids = [[f"many-{i}", 0] for i in range(24)]
    for i in range(len(tids)):  # before D's first registration starts its watchdog
        p.call("fill", blocks=[64 + i], seed=1000 + i)
    for i, tid in enumerate(tids):
        d.call("expect", tid=tid, p_address=p.address)
        d.call("allocate", tid=tid, blocks=[100 + i])
    for i, tid in enumerate(tids):
        p.call("kv_ready", tid=tid, blocks=[64 + i])
    for i, tid in enumerate(tids):
        _assert_delivered(p, d, tid, [64 + i], [100 + i])


def test_decode_cancels_before_the_write_blocks_come_back_only_after_the_ack(pair):
    p, d = pair
    tid = ["cancelled", 0]
    d.call("fill", blocks=[70, 71], seed=5)
    before = d.call("digest", blocks=[70, 71])["digest"]
    d.call("expect", tid=tid, p_address=p.address)
    d.call("allocate", tid=tid, blocks=[70, 71])
    d.call("abort", tid=tid, reason="client disconnected")
    freed = d.event_for("free", tid, timeout=10)  # CancelAck, well before the 24.2 s fence
    assert sorted(freed["blocks"]) == [70, 71]
    p.call("fill", blocks=[72, 73], seed=6)
    p.call("kv_ready", tid=tid, blocks=[72, 73])
    assert sorted(p.event_for("free", tid)["blocks"]) == [72, 73]  # P writes nothing
    assert d.call("digest", blocks=[70, 71])["digest"] == before


def test_blocks_are_back_after_every_transfer(pair):
    p, d = pair
    for peer in pair:
        stats = peer.call("stats")
        assert stats["outstanding_blocks"] == 0 and stats["live"] == 0, stats


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (2, 2), (1, 2)], ids=["P-TP2-to-D-TP1", "P-TP2-to-D-TP2",
                                                                     "P-TP1-to-D-TP2"])
def test_tensor_parallel_ranks_write_their_heads_into_place(fabric, p_tp, d_tp):
    """One process per rank, as vLLM runs one worker per rank: each P rank writes its KV heads into
    the D rank(s) holding them, at the right offset inside each block, and D loads only once every
    P rank it owes has written."""
    from neuron_disagg.local_cluster import free_port

    p_port, d_port = free_port(), free_port()
    ranks = []
    try:
        ps = [fabric.peer("prefill", "--port", str(p_port), "--tp-rank", str(r), "--tp-size", str(p_tp),
                          "--lease-s", "5") for r in range(p_tp)]
        ranks += ps
        ds = [fabric.peer("decode", "--port", str(d_port), "--tp-rank", str(r), "--tp-size", str(d_tp),
                          "--watchdog-s", "5", "--max-write-s", "2") for r in range(d_tp)]
        ranks += ds
        tid, p_blocks, d_blocks = ["tp", 0], [3, 7, 8], [10, 11, 30]
        for r, p in enumerate(ps):
            p.call("fill", blocks=p_blocks, seed=100 + r)  # each rank's heads differ
        for d in ds:
            d.call("expect", tid=tid, p_address=ps[0].address, p_tp=p_tp)
            d.call("allocate", tid=tid, blocks=d_blocks)
        for p in ps:
            p.call("kv_ready", tid=tid, blocks=p_blocks)
        for d in ds:
            d.event_for("loaded", tid)
        for p in ps:
            assert sorted(p.event_for("free", tid)["blocks"]) == p_blocks
        for p_block, d_block in zip(p_blocks, d_blocks, strict=True):
            # HND: a block holds its heads one after another, so the model's block is the P ranks'
            # blocks end to end, and D rank j holds its slice of that.
            shares = [[bytes.fromhex(h) for h in p.call("read", block=p_block)["regions"]] for p in ps]
            whole = [b"".join(share[region] for share in shares) for region in range(len(shares[0]))]
            for j, d in enumerate(ds):
                got = [bytes.fromhex(h) for h in d.call("read", block=d_block)["regions"]]
                size = len(whole[0]) // d_tp
                assert got == [w[j * size:(j + 1) * size] for w in whole], f"D rank {j}, block {d_block}"
    finally:
        for rank in ranks:
            rank.stop()


def test_with_the_blocks_outermost_a_run_of_blocks_is_one_descriptor_for_every_layer_and_lands_exactly(fabric):
    """P and D lay their KV out as vLLM's BLHNC does: every layer's K and V share of a block back
    to back in it. A run of blocks (continuing on both sides, in any token order) is then one
    NIXL descriptor across all the layers' regions, inside the one span each side registered."""
    p = fabric.peer("prefill", "--layout", "blocks-outermost", "--lease-s", "5")
    d = fabric.peer("decode", "--layout", "blocks-outermost", "--watchdog-s", "20", "--max-write-s", "2")
    try:
        regions = len(p.call("regions")["regions"]["regions"])
        tid, p_blocks, d_blocks = ["outermost", 0], [9, 8, 7, 3, 4], [22, 21, 20, 40, 41]  # two runs
        _transfer(p, d, tid, p_blocks, d_blocks, seed=11)
        _assert_delivered(p, d, tid, p_blocks, d_blocks)
        assert regions > 2 and p.call("stats")["writer"]["descriptors"] == 2  # layer-major: 2 a region
    finally:
        p.stop()
        d.stop()
