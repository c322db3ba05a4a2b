"""What the connector's geometry reading refuses at start-up, each with the setting that avoids it,
and what every region carries: its tensor's device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="torch's CPU build is installed with vLLM by scripts/setup.sh")

from neuron_disagg.platforms.kv_layout import (  # noqa: E402
    BLOCKS, HEAD, HEADS, KV, TOKENS, VLLM_LAYER_VIEW, KVGeometry, UnsupportedKVLayout, regions_from_kv_caches,
)


GEOMETRY = KVGeometry(16, 0, 1, None)


def regions(tensor, dims=VLLM_LAYER_VIEW, geometry=GEOMETRY):
    return regions_from_kv_caches({"layer.0": tensor}, {"layer.0": dims}, geometry)


@pytest.mark.parametrize("tensor,dims,geometry,setting", [
    # a head's values strided (e.g. a view that splits K and V by channel)
    (torch.zeros(4, 2, 16, 32)[..., ::2], VLLM_LAYER_VIEW, KVGeometry(16), "VLLM_KV_CACHE_LAYOUT=LBHNC"),
    # kernel blocks of 12 tokens cannot tile the scheduler's 16
    (torch.zeros(4, 2, 12, 16), VLLM_LAYER_VIEW, KVGeometry(16), "--block-size"),
    # K and V stored as separate head slots (FlashInfer's nvfp4): 4 "heads" where the model has 2
    (torch.zeros(4, 4, 16, 16), VLLM_LAYER_VIEW, KVGeometry(16, 0, 1, 2), "--kv-cache-dtype auto"),
    # a layer with no token dimension at all (a raw state buffer)
    (torch.zeros(64, 128), (BLOCKS, HEAD), KVGeometry(16), "cannot be transferred"),
    # heads that cannot be split over the ranks
    (torch.zeros(4, 1, 16, 16), VLLM_LAYER_VIEW, KVGeometry(16, 0, 3, 4), "cannot be split over TP 3"),
])
def test_what_cannot_be_described_is_refused_naming_the_setting(tensor, dims, geometry, setting):
    with pytest.raises(UnsupportedKVLayout, match=setting.replace("(", r"\(")):
        regions(tensor, dims, geometry)


def test_regions_carry_their_tensors_device():
    """vLLM registers tensor.get_device(); a region on GPU 3 must say 3, not 0."""
    tensor = torch.zeros(2, 4, 2, 16, 8)

    class OnDevice3:
        def __getattr__(self, name):
            return getattr(tensor, name)

        device = SimpleNamespace(type="cuda", index=3)

    (k, v) = regions(OnDevice3(), (KV, BLOCKS, HEADS, TOKENS, HEAD))
    assert k.device_id == v.device_id == 3
    assert regions(tensor, (KV, BLOCKS, HEADS, TOKENS, HEAD))[0].device_id == 0  # a CPU tensor: 0
