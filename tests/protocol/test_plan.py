import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from neuron_disagg.protocol import PlanError, RankRegions, Registration, TransferId, peer_ranks, plan_write
from neuron_disagg.protocol.geometry import ModelShape, rank_regions, regions_bytes
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
        for pos, d_block in zip([2, 3, 4], [20, 21, 22]):
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
