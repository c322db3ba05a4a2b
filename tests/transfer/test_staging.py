"""Host staging's slots and copies, on CPU torch tensors shaped as vLLM lays KV out."""

import pytest

torch = pytest.importorskip("torch", reason="torch's CPU build is installed with vLLM by scripts/setup.sh")

from neuron_disagg.platforms.kv_layout import (  # noqa: E402
    BLOCKS, HEAD, HEADS, KV, TOKENS, VLLM_LAYER_VIEW, KVGeometry, described_kv_caches, staging_rows,
)
from neuron_disagg.transfer.staging import HostStaging  # noqa: E402

DIMS = {"layers.0": VLLM_LAYER_VIEW, "layers.1": (KV, BLOCKS, TOKENS, HEADS, HEAD)}


def _caches(blocks=10):
    torch.manual_seed(0)
    return {"layers.0": torch.randn(blocks, 2, 16, 8, dtype=torch.bfloat16),       # vLLM 0.29+: (blocks, heads, tokens, ch)
            "layers.1": torch.randn(2, blocks, 16, 2, 4, dtype=torch.bfloat16)}    # planes: (2, blocks, tokens, heads, d)


def _described(caches):
    return described_kv_caches(caches, DIMS, KVGeometry(block_tokens=16))


def regions_from_kv_caches(caches, _rank):
    return tuple(region for region, _ in _described(caches))


def kv_views(caches):
    return staging_rows(_described(caches))


def test_blocks_round_trip_through_host_slots_into_other_blocks():
    caches = _caches()
    regions = regions_from_kv_caches(caches, 0)
    staging = HostStaging(kv_views(caches), regions, slots=4)
    assert [r.num_blocks for r in staging.regions] == [4, 4, 4]
    assert all(s.base_addr != r.base_addr and s.block_stride_bytes == r.block_stride_bytes
               for s, r in zip(staging.regions, regions, strict=True))
    before = {name: t.clone() for name, t in caches.items()}
    staging.to_host([7, 2], [3, 0])
    staging.to_device([3, 0], [5, 9])
    assert torch.equal(caches["layers.0"][5], before["layers.0"][7])
    assert torch.equal(caches["layers.0"][9], before["layers.0"][2])
    assert torch.equal(caches["layers.1"][:, 5], before["layers.1"][:, 7])
    assert torch.equal(caches["layers.1"][:, 9], before["layers.1"][:, 2])
    untouched = [b for b in range(10) if b not in (5, 9)]
    assert torch.equal(caches["layers.0"][untouched], before["layers.0"][untouched])


def test_slot_bytes_are_where_the_regions_say():
    """NIXL writes by address: a slot's bytes must sit at base_addr + slot * stride."""
    caches = _caches()
    staging = HostStaging(kv_views(caches), regions_from_kv_caches(caches, 0), slots=3)
    staging.to_host([4], [2])
    region = staging.regions[0]
    import ctypes
    raw = ctypes.string_at(region.base_addr + 2 * region.block_stride_bytes, region.block_stride_bytes)
    assert raw == caches["layers.0"][4].contiguous().view(torch.uint8).numpy().tobytes()


def test_waiting_for_slots_is_first_come_first_served():
    caches = _caches()
    staging = HostStaging(kv_views(caches), regions_from_kv_caches(caches, 0), slots=4)
    got = []
    staging.take("a", (10, 11, 12), lambda s: got.append(("a", s)))
    staging.take("b", (13, 14), lambda s: got.append(("b", s)))
    staging.take("c", (15,), lambda s: got.append(("c", s)))  # would fit now, but waits behind b
    assert got == [("a", (0, 1, 2))]
    staging.release("a")
    assert [name for name, _ in got] == ["a", "b", "c"]
    assert staging.free_slots == 4 - 2 - 1
    with pytest.raises(ValueError, match="host_staging_blocks"):
        staging.take("d", tuple(range(5)), got.append)


@pytest.mark.parametrize("scattered", [False, True], ids=["runs", "scattered"])
def test_many_blocks_by_runs_or_scattered_arrive_intact(scattered):
    caches = _caches(blocks=64)
    regions = regions_from_kv_caches(caches, 0)
    staging = HostStaging(kv_views(caches), regions, slots=40)
    blocks = list(range(0, 64, 2))[:30] if scattered else list(range(10, 40))
    targets = list(range(63, 33, -1)) if scattered else list(range(40, 64)) + list(range(4, 10))
    slots = list(range(5, 35))
    before = {name: t.clone() for name, t in caches.items()}
    staging.to_host(blocks, slots)
    staging.to_device(slots, targets)
    for src, dst in zip(blocks, targets, strict=True):
        assert torch.equal(caches["layers.0"][dst], before["layers.0"][src])
        assert torch.equal(caches["layers.1"][:, dst], before["layers.1"][:, src])


def test_slots_given_back_out_of_order_are_handed_out_as_a_run():
    caches = _caches()
    staging = HostStaging(kv_views(caches), regions_from_kv_caches(caches, 0), slots=6)
    got = []
    for tid in ("a", "b", "c"):
        staging.take(tid, (1, 2), got.append)
    staging.release("c")
    staging.release("a")
    staging.take("d", (1, 2, 3, 4), got.append)
    assert got[-1] == (0, 1, 4, 5)
    staging.release("b")
    staging.release("d")
    staging.take("e", tuple(range(6)), got.append)
    assert got[-1] == tuple(range(6))
