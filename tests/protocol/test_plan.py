import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from neuron_disagg.protocol import PlanError, RankRegions, Registration, TransferId, peer_ranks, plan_write
from neuron_disagg.protocol.geometry import ModelShape, rank_regions, regions_bytes
from neuron_disagg.protocol.plan import WritePlan, split_by_group
from neuron_disagg.transfer.memory import MemoryFabric

SHAPE = ModelShape(num_layers=3, num_kv_heads=4, head_dim=8, dtype_bytes=2, block_tokens=4)
NUM_BLOCKS = 32


def registration(d_tp, dst_blocks, first=0, layout="HND", shape=SHAPE, num_blocks=NUM_BLOCKS):
    ranks = tuple(
        RankRegions(r, f"d{r}", rank_regions(shape, num_blocks, r, d_tp, layout=layout))
        for r in range(d_tp))
    return Registration(TransferId("req"), "d-engine", "d-req", "127.0.0.1:1", d_tp, ranks,
                        tuple(dst_blocks), first, expires_at=1e9)


@pytest.mark.parametrize("my_rank,my_tp,peer_tp,expected", [
    (0, 1, 1, (0,)), (0, 1, 4, (0, 1, 2, 3)), (1, 2, 4, (2, 3)), (3, 4, 2, (1,)),
    (0, 4, 1, (0,)), (1, 3, 2, (0, 1)), (2, 3, 2, (1,)),
])
def test_peer_ranks(my_rank, my_tp, peer_tp, expected):
    assert peer_ranks(my_rank, my_tp, peer_tp) == expected


def test_contiguous_blocks_merge_to_one_descriptor_per_region():
    local = rank_regions(SHAPE, NUM_BLOCKS)
    plan = plan_write(local, 0, 1, registration(1, range(10, 18)), list(range(3, 11)))
    (write,) = plan.writes
    assert plan.unmerged_count == 8 * len(local)
    assert len(write) == len(local)  # one run per layer and K/V
    assert plan.bytes == 8 * len(local) * local[0].block_bytes


def test_fragmented_blocks_give_one_descriptor_per_run():
    local = rank_regions(SHAPE, NUM_BLOCKS)
    src = [1, 2, 3, 7, 8, 20]
    dst = [5, 6, 7, 8, 9, 30]  # runs where both sides continue: 1-3 -> 5-7, 7-8 -> 8-9, 20 -> 30
    plan = plan_write(local, 0, 1, registration(1, dst), src)
    assert len(plan.writes[0]) == 3 * len(local)


def _logical(region_name, heads, first_head, block_pos, tokens, head_bytes, seed):
    """The logical KV content [head, token, byte] of one block position, for the given heads."""
    rng = np.random.default_rng(abs(hash((region_name, block_pos, seed))) % (2**32))
    full = rng.integers(0, 256, size=(SHAPE.num_kv_heads, tokens, head_bytes), dtype=np.uint8)
    return full[first_head:first_head + heads]


def _expected(region, block_pos, seed):
    data = _logical(region.name, region.heads, region.first_head, block_pos, region.block_tokens,
                    region.head_bytes, seed)
    return data if region.layout == "HND" else data.transpose(1, 0, 2)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 2), (1, 2), (2, 1), (4, 2), (2, 4)])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_tp_mismatch_and_layout_move_every_head_to_the_right_slot(p_tp, d_tp, layout):
    """P ranks write their heads' slices into the D ranks that hold them; compare D's memory with
    the logical KV of every block position."""
    fabric = MemoryFabric()
    n = 6
    src_blocks = [4, 5, 9, 10, 11, 2]  # P block for logical position i
    dst_blocks = [7, 8, 9, 1, 2, 3]
    reg = registration(d_tp, dst_blocks, layout=layout)
    for rank in reg.ranks:
        fabric.register(rank.agent_name, regions_bytes(rank.regions))
    for p in range(p_tp):
        local = rank_regions(SHAPE, NUM_BLOCKS, p, p_tp, layout=layout)
        mem = np.frombuffer(fabric.register(f"p{p}", regions_bytes(local)), dtype=np.uint8)
        for region in local:
            for pos, b in enumerate(src_blocks):
                start = region.base_addr + b * region.block_stride_bytes
                mem[start:start + region.block_bytes] = _expected(region, pos, seed=1).ravel()
        plan = plan_write(local, p, p_tp, reg, src_blocks)
        assert {w.d_rank for w in plan.writes} == set(peer_ranks(p, p_tp, d_tp))
        fabric.execute(f"p{p}", plan)
    for rank in reg.ranks:
        mem = np.frombuffer(fabric.memory[rank.agent_name], dtype=np.uint8)
        for region in rank.regions:
            for pos, b in enumerate(dst_blocks[:n]):
                start = region.base_addr + b * region.block_stride_bytes
                got = mem[start:start + region.block_bytes]
                assert np.array_equal(got, _expected(region, pos, seed=1).ravel()), (rank.tp_rank, region.name, pos)


def test_prefix_hit_writes_only_the_tail_into_the_right_slots():
    fabric = MemoryFabric()
    local = rank_regions(SHAPE, NUM_BLOCKS)
    src_blocks = [3, 4, 5, 6, 7]
    # D already holds positions 0 and 1; it registers blocks for positions 2, 3, 4 only.
    reg = registration(1, [20, 21, 22], first=2)
    plan = plan_write(local, 0, 1, reg, src_blocks)
    for region in local:
        stride = region.block_stride_bytes
        srcs = plan.writes[0].src_addr
        covered = {int((a - region.base_addr) // stride) for a in srcs
                   if region.base_addr <= a < region.base_addr + stride * region.num_blocks}
        assert covered == {5}  # one merged run starting at P block 5 (positions 2..4)
    assert plan.bytes == 3 * len(local) * local[0].block_bytes
    p_mem = np.frombuffer(fabric.register("p", regions_bytes(local)), dtype=np.uint8)
    p_mem[:] = np.arange(len(p_mem), dtype=np.uint64).astype(np.uint8)
    d_mem = np.frombuffer(fabric.register("d0", regions_bytes(local)), dtype=np.uint8)
    fabric.execute("p", plan)
    for region in local:
        for pos, d_block in zip([2, 3, 4], [20, 21, 22], strict=True):
            s = region.base_addr + src_blocks[pos] * region.block_stride_bytes
            d = region.base_addr + d_block * region.block_stride_bytes
            assert np.array_equal(d_mem[d:d + region.block_bytes], p_mem[s:s + region.block_bytes])


def test_full_prefix_hit_plans_nothing():
    plan = plan_write(rank_regions(SHAPE, NUM_BLOCKS), 0, 1, registration(1, [], first=3), [1, 2, 3])
    assert plan.descriptor_count == 0 and plan.bytes == 0


@pytest.mark.parametrize("mutate,message", [
    (lambda r: registration(1, [1, 2, NUM_BLOCKS]), "block ids must lie"),
    (lambda r: registration(1, [1, 1, 2]), "listed one destination block twice"),
    (lambda r: registration(1, [1, 2]), "holds 3 blocks"),
    (lambda r: registration(1, [1, 2, 3], first=-1), "holds 3 blocks"),
    (lambda r: registration(1, [1, 2, 3], shape=ModelShape(2, 4, 8, 2, 4)), "different KV regions"),
    (lambda r: registration(1, [1, 2, 3], shape=ModelShape(3, 4, 16, 2, 4)), "head_bytes differs"),
])
def test_inconsistent_registrations_are_rejected_before_any_write(mutate, message):
    with pytest.raises(PlanError, match=message):
        plan_write(rank_regions(SHAPE, NUM_BLOCKS), 0, 1, mutate(None), [5, 6, 7])


def test_registration_missing_a_rank_is_rejected():
    reg = registration(2, [1, 2, 3])
    import msgspec
    reg = msgspec.structs.replace(reg, ranks=reg.ranks[:1])
    with pytest.raises(PlanError, match="lacks decode rank 1"):
        plan_write(rank_regions(SHAPE, NUM_BLOCKS, 0, 1), 0, 1, reg, [5, 6, 7])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_plan_covers_exactly_the_blocks_bytes_without_overlap(data):
    n = data.draw(st.integers(0, 12))
    src = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=True))
    dst = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=True))
    first = data.draw(st.integers(0, n))
    p_tp, d_tp = data.draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 4), (4, 4)]))
    p_rank = data.draw(st.integers(0, p_tp - 1))
    local = rank_regions(SHAPE, NUM_BLOCKS, p_rank, p_tp)
    plan = plan_write(local, p_rank, p_tp, registration(d_tp, dst[first:], first), src)
    heads_per_d = SHAPE.num_kv_heads // d_tp
    heads_per_p = SHAPE.num_kv_heads // p_tp
    overlap = sum(min(heads_per_p, heads_per_d) for _ in peer_ranks(p_rank, p_tp, d_tp))
    per_head_block = SHAPE.block_tokens * SHAPE.head_dim * SHAPE.dtype_bytes
    assert plan.bytes == (n - first) * len(local) * overlap * per_head_block
    assert plan.descriptor_count <= plan.unmerged_count
    for write in plan.writes:
        order = np.argsort(write.dst_addr)
        starts, lengths = write.dst_addr[order], write.length[order]
        assert np.all(starts[1:] >= starts[:-1] + lengths[:-1]), "destination ranges overlap"
        # merged: within one region, no two descriptors that could still be merged stay apart
        region_bytes = local[0].block_stride_bytes * NUM_BLOCKS
        same_region = (write.src_addr[1:] // region_bytes) == (write.src_addr[:-1] // region_bytes)
        cont = (write.src_addr[1:] == write.src_addr[:-1] + write.length[:-1]) & \
               (write.dst_addr[1:] == write.dst_addr[:-1] + write.length[:-1])
        assert not (cont & same_region).any()


# -- merging in source order: block lists that vLLM's free queue hands out after churn --------------

LAYOUTS = ("HND", "NHD", "kernel blocks", "heads outside blocks", "layers inside blocks")


def _regions(layout, rank=0, tp=1):
    """One rank's regions of SHAPE in ``layout``: rank_regions' own two, or a block split into two
    head-major kernel blocks of two tokens, or each head's blocks in a plane of their own, or
    every layer's (and K's and V's) share of a block back to back in it (vLLM's BLHNC)."""
    regions = rank_regions(SHAPE, NUM_BLOCKS, rank, tp, layout="NHD" if layout == "NHD" else "HND",
                           blocks_outermost=layout == "layers inside blocks")
    hb, tokens = SHAPE.head_dim * SHAPE.dtype_bytes, SHAPE.block_tokens
    if layout == "kernel blocks":
        k = tokens // 2
        return tuple(msgspec.structs.replace(r, kernel_block_tokens=k, kernel_stride_bytes=r.heads * k * hb,
                                             head_stride_bytes=k * hb, token_stride_bytes=hb) for r in regions)
    if layout == "heads outside blocks":
        return tuple(msgspec.structs.replace(r, block_stride_bytes=tokens * hb, token_stride_bytes=hb,
                                             head_stride_bytes=NUM_BLOCKS * tokens * hb) for r in regions)
    return regions


def _registration_in(layout, d_tp, dst_blocks, first=0):
    ranks = tuple(RankRegions(r, f"d{r}", _regions(layout, r, d_tp)) for r in range(d_tp))
    return Registration(TransferId("req"), "d-engine", "d-req", "127.0.0.1:1", d_tp, ranks,
                        tuple(dst_blocks), first, expires_at=1e9)


def _bytes_moved(plan):
    """Every byte the plan moves as rows (D rank, source address, destination address), sorted:
    what the plan does, whatever order and grouping its descriptors have."""
    rows = [np.empty((0, 3), dtype=np.int64)]
    for w in plan.writes:
        n = w.length.astype(np.int64)
        within = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
        rows.append(np.stack([np.full(n.sum(), w.d_rank), np.repeat(w.src_addr.astype(np.int64), n) + within,
                              np.repeat(w.dst_addr.astype(np.int64), n) + within], axis=1))
    moved = np.concatenate(rows)
    return moved[np.lexsort(moved.T[::-1])]


def _region_of(addr, local):
    bases = np.array(sorted(r.base_addr for r in local), dtype=np.uint64)
    return np.searchsorted(bases, addr, side="right") - 1


def _token_order_count(unmerged, local):
    """Descriptors the plan would have if runs merged only in token order, from the unmerged plan
    (its descriptors run region by region, each region's in token order)."""
    count = 0
    for w in unmerged.writes:
        s, d, n, region = w.src_addr, w.dst_addr, w.length, _region_of(w.src_addr, local)
        cont = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1]) & (region[1:] == region[:-1])
        count += len(n) - int(cont.sum())
    return count


def _nothing_left_to_merge(plan, local):
    """No descriptor starts where another in the same region ends on both sides, in any order."""
    for w in plan.writes:
        s, d, n, region = (a.tolist() for a in (w.src_addr, w.dst_addr, w.length, _region_of(w.src_addr, local)))
        ends = {(a + k, b + k, r) for a, b, k, r in zip(s, d, n, region, strict=True)}
        if ends & set(zip(s, d, region, strict=True)):
            return False
    return True


def test_blocks_handed_out_descending_on_both_sides_merge_to_one_descriptor_per_region():
    """After churn vLLM's free queue gives P and D descending block ids: in token order no two
    neighbours continue each other, in source order they all do."""
    local = rank_regions(SHAPE, NUM_BLOCKS)
    src, dst = list(range(20, 12, -1)), list(range(30, 22, -1))
    plan = plan_write(local, 0, 1, registration(1, dst), src)
    unmerged = plan_write(local, 0, 1, registration(1, dst), src, merge=False)
    assert plan.descriptor_count == len(local)
    assert np.array_equal(_bytes_moved(plan), _bytes_moved(unmerged))
    _lands_byte_exact(plan, local, src, dst)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1), (2, 4)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_descending_block_lists_merge_as_far_as_the_same_blocks_ascending(layout, p_tp, d_tp):
    """Whatever the layout or TP split, reversing both lists changes neither the bytes moved nor
    the descriptor count: the order of the token positions no longer matters."""
    src, dst = list(range(5, 13)), list(range(17, 25))
    for p in range(p_tp):
        local = _regions(layout, p, p_tp)
        ascending = plan_write(local, p, p_tp, _registration_in(layout, d_tp, dst), src)
        descending = plan_write(local, p, p_tp, _registration_in(layout, d_tp, dst[::-1]), src[::-1])
        unmerged = plan_write(local, p, p_tp, _registration_in(layout, d_tp, dst[::-1]), src[::-1], merge=False)
        assert descending.descriptor_count == ascending.descriptor_count
        if p_tp == d_tp:  # whole blocks on both sides: runs span blocks (split heads may not)
            assert descending.descriptor_count < unmerged.descriptor_count
        assert np.array_equal(_bytes_moved(descending), _bytes_moved(unmerged))


@st.composite
def _block_lists(draw):
    """P's and D's blocks of one request: random, or D's in the order of P's (both from one pool
    state), or in its reverse; D's ids scattered or one run; a prefix D already holds."""
    n = draw(st.integers(1, 12))
    src = draw(st.permutations(range(NUM_BLOCKS)))[:n]
    if draw(st.booleans()):
        start = draw(st.integers(0, NUM_BLOCKS - n))
        values = list(range(start, start + n))
    else:
        values = sorted(draw(st.permutations(range(NUM_BLOCKS)))[:n])
    order = draw(st.sampled_from(["random", "same", "reversed"]))
    if order == "random":
        dst = draw(st.permutations(values))
    else:
        ranks = np.argsort(np.argsort(src))
        dst = [values[r] if order == "same" else values[n - 1 - r] for r in ranks]
    return src, list(dst), draw(st.integers(0, n))


@settings(max_examples=150, deadline=None)
@given(_block_lists(), st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS),
       st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 4), (4, 4)]), st.data())
def test_source_ordered_merging_moves_every_byte_as_the_per_block_plan_does(lists, p_layout, d_layout, tps, data):
    src, dst, first = lists
    p_tp, d_tp = tps
    p_rank = data.draw(st.integers(0, p_tp - 1))
    local = _regions(p_layout, p_rank, p_tp)
    reg = _registration_in(d_layout, d_tp, dst[first:], first)
    plan = plan_write(local, p_rank, p_tp, reg, src)
    unmerged = plan_write(local, p_rank, p_tp, reg, src, merge=False)
    assert np.array_equal(_bytes_moved(plan), _bytes_moved(unmerged))
    assert plan.descriptor_count <= _token_order_count(unmerged, local)
    assert _nothing_left_to_merge(plan, local)


@settings(max_examples=60, deadline=None)
@given(_block_lists(), st.sampled_from(LAYOUTS), st.sampled_from([(1, 1), (2, 1), (1, 2)]), st.integers(1, 6),
       st.data())
def test_a_write_parted_by_layer_group_moves_the_same_bytes_each_part_from_its_own_groups_regions(
        lists, layout, tps, groups, data):
    """Streaming by layers posts each group's part once its layers ran: together the parts are the
    write, and no part reads a byte of another group's layers (it would read KV not yet computed)."""
    src, dst, first = lists
    p_tp, d_tp = tps
    p_rank = data.draw(st.integers(0, p_tp - 1))
    local = _regions(layout, p_rank, p_tp)
    group_of_region = tuple(sorted(data.draw(st.lists(st.integers(0, groups - 1), min_size=len(local),
                                                      max_size=len(local)))))
    reg = _registration_in(layout, d_tp, dst[first:], first)
    plan = plan_write(local, p_rank, p_tp, reg, src, join=group_of_region)
    region_of_byte = _region_of_bytes(plan_write(local, p_rank, p_tp, reg, src, merge=False))
    parted = []
    for write in plan.writes:
        parts = split_by_group(write, group_of_region)
        assert [g for g, _ in parts] == sorted({g for g, _ in parts})
        assert sum(part.unmerged_count for _, part in parts) == write.unmerged_count
        for g, part in parts:
            assert part.d_rank == write.d_rank and len(part)
            assert _groups_read(part, region_of_byte, group_of_region) == {g}, f"group {g}'s part reads another's"
            parted.append(part)
    assert np.array_equal(_bytes_moved(WritePlan(tuple(parted))), _bytes_moved(plan))


def _region_of_bytes(unmerged):
    """Each source byte's region, from a plan that merged nothing (its descriptors never leave one)."""
    owner = {}
    for w in unmerged.writes:
        for a, n, r in zip(w.src_addr.tolist(), w.length.tolist(), w.src_region.tolist(), strict=True):
            owner.update(dict.fromkeys(range(a, a + n), r))
    return owner


def _groups_read(write, region_of_byte, group_of_region):
    return {group_of_region[region_of_byte[b]]
            for a, n in zip(write.src_addr.tolist(), write.length.tolist(), strict=True) for b in range(a, a + n)}


# -- joining across regions: every layer's share of a block back to back (vLLM's BLHNC) -------------

def test_with_blocks_outermost_on_both_sides_every_layer_of_a_run_of_blocks_is_one_descriptor():
    """After churn both lists descend: per region they merge to a run each (one descriptor per
    layer and K/V), and with the layers inside each block, across the regions to one."""
    local = _regions("layers inside blocks")
    src, dst = list(range(20, 12, -1)), list(range(30, 22, -1))
    reg = _registration_in("layers inside blocks", 1, dst)
    plan = plan_write(local, 0, 1, reg, src)
    assert plan.descriptor_count == 1
    assert plan.writes[0].length[0] == len(src) * len(local) * local[0].block_bytes
    layer_major = plan_write(_regions("HND"), 0, 1, _registration_in("HND", 1, dst), src)
    assert layer_major.descriptor_count == len(local)
    _lands_byte_exact(plan, local, src, dst)


def test_with_blocks_outermost_scattered_blocks_give_one_descriptor_per_run_whatever_the_layers():
    local = _regions("layers inside blocks")
    src = [1, 2, 3, 7, 8, 20]
    dst = [5, 6, 7, 9, 10, 30]  # runs where both sides continue: 1-3 -> 5-7, 7-8 -> 9-10, 20 -> 30
    plan = plan_write(local, 0, 1, _registration_in("layers inside blocks", 1, dst), src)
    assert plan.descriptor_count == 3
    _lands_byte_exact(plan, local, src, dst)


def test_descriptors_join_across_regions_only_within_a_join_class():
    """Streaming by layers parts a write by group of layers; a descriptor that ran from one group's
    layers into the next would be posted when the first group ran, reading KV not yet computed."""
    local = _regions("layers inside blocks")
    src, dst = list(range(4, 12)), list(range(20, 28))
    reg = _registration_in("layers inside blocks", 1, dst)
    groups = tuple(i * 3 // len(local) for i in range(len(local)))  # three groups of consecutive layers
    region_of_byte = _region_of_bytes(plan_write(local, 0, 1, reg, src, merge=False))
    joined = plan_write(local, 0, 1, reg, src, join=groups)
    # a block's layers of one group are one descriptor; that group's layers of the next block are
    # not next to them, and the next group's are but may not join them
    assert joined.descriptor_count == len(src) * 3
    parts = split_by_group(joined.writes[0], groups)
    assert [_groups_read(part, region_of_byte, groups) for _, part in parts] == [{0}, {1}, {2}]
    unjoined = plan_write(local, 0, 1, reg, src)  # one class: parting it by group goes wrong
    assert unjoined.descriptor_count == 1
    assert _groups_read(split_by_group(unjoined.writes[0], groups)[0][1], region_of_byte, groups) == {0, 1, 2}
    _lands_byte_exact(joined, local, src, dst)


def test_regions_back_to_back_are_not_joined_but_each_merges_its_own_runs():
    """A region per layer, one after another (vLLM's layer-major layouts): a descriptor could run
    on into the next region only from a last block into a first, so no pass is made for it."""
    local = _regions("HND")
    last = NUM_BLOCKS - 1
    plan = plan_write(local, 0, 1, _registration_in("HND", 1, [last, 0]), [last, 0])
    assert plan.descriptor_count == 2 * len(local)


def _lands_byte_exact(plan, local, src, dst):
    """The plan, executed between two memories laid out as ``local``, puts each of P's blocks ``src``
    byte for byte into D's ``dst``, in every region."""
    fabric = MemoryFabric()
    p_mem = np.frombuffer(fabric.register("p", regions_bytes(local)), dtype=np.uint8)
    p_mem[:] = np.random.default_rng(5).integers(0, 256, len(p_mem), dtype=np.uint8)
    d_mem = np.frombuffer(fabric.register("d0", regions_bytes(local)), dtype=np.uint8)
    fabric.execute("p", plan)
    for region in local:
        for s, d in zip(src, dst, strict=True):
            at_s = region.base_addr + s * region.block_stride_bytes
            at_d = region.base_addr + d * region.block_stride_bytes
            assert np.array_equal(d_mem[at_d:at_d + region.block_bytes], p_mem[at_s:at_s + region.block_bytes])
