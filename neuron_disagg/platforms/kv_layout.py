"""Describe vLLM's KV cache tensors as regions, from what the attention backend declares.

For each layer the connector's vLLM layer says what every dimension of the tensor holds
(``KVDims``): from the backend's own ``get_kv_cache_shape`` where it has one (vLLM 0.24–0.28's
backends, the Neuron plugin's head-major ``(2, blocks, heads, tokens, head)``), else vLLM 0.29+'s
fixed per-layer view ``(blocks, heads, tokens, content)``. Where each dimension lies in memory comes
from the tensor's strides, never from a guess at its shape or from ``is_contiguous()``: token-major
and head-major blocks, layers or heads outside blocks, K and V as planes or packed per head, a
scheduler block split into kernel blocks, padded pages — all are described exactly by a ``Region``.
What cannot be described is refused at startup with the reason and the setting that avoids it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from ..protocol.errors import PlanError
from ..protocol.messages import Region
from ..protocol.plan import rank_heads

BLOCKS, KV, TOKENS, HEADS, HEAD = "blocks", "kv", "tokens", "heads", "head"
#: The per-layer view vLLM 0.29+ hands every connector: (blocks, heads, tokens, content), where the
#: content of one (head, token) is K then V (GPU), K and V by halves of the head (CPU), or MLA's
#: latent vector (one head).
VLLM_LAYER_VIEW = (BLOCKS, HEADS, TOKENS, HEAD)


class UnsupportedKVLayout(ValueError):
    """The KV tensors cannot be described as regions; the message says why and what to change."""


@dataclass(frozen=True)
class KVGeometry:
    """What the whole rank shares: the scheduler's block size and how KV heads lie on the ranks."""

    block_tokens: int
    tp_rank: int = 0
    tp_size: int = 1
    total_heads: int | None = None  # the model's KV heads (1 for MLA); None: each rank's own


def regions_from_kv_caches(kv_caches: Mapping[str, Any], dims: Mapping[str, tuple[str, ...]],
                           geometry: KVGeometry) -> tuple[Region, ...]:
    """One region per layer (two where K and V are separate planes), in ``kv_caches`` order."""
    return tuple(region for region, _ in described_kv_caches(kv_caches, dims, geometry))


def described_kv_caches(kv_caches: Mapping[str, Any], dims: Mapping[str, tuple[str, ...]],
                        geometry: KVGeometry) -> list[tuple[Region, Any]]:
    """(region, the tensor it lies in) pairs. A tensor listed under several names (vLLM's KV
    sharing between layers) is described once."""
    described: list[tuple[Region, Any]] = []
    seen: set[tuple] = set()
    for name, tensor in kv_caches.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key in seen:
            continue
        seen.add(key)
        described.extend((region, tensor) for region in _layer_regions(name, tensor, dims[name], geometry))
    return described


def _layer_regions(name: str, tensor: Any, dims: tuple[str, ...], g: KVGeometry) -> list[Region]:
    shape, elem = tuple(tensor.shape), tensor.element_size()
    if len(dims) != len(shape) or len(set(dims)) != len(dims) or not {BLOCKS, TOKENS, HEAD} <= set(dims) \
            or not set(dims) <= {BLOCKS, KV, TOKENS, HEADS, HEAD}:
        raise UnsupportedKVLayout(
            f"KV cache {name} has shape {shape}, declared as {dims}: neuron-disagg needs blocks, tokens "
            "and a head dimension; this attention backend's cache cannot be transferred")
    size = dict(zip(dims, shape, strict=True))
    stride = {d: s * elem for d, s in zip(dims, tensor.stride(), strict=True)}
    if stride[HEAD] != elem:
        raise UnsupportedKVLayout(
            f"KV cache {name}: one head's values are not contiguous (strides {tuple(tensor.stride())}); "
            "set VLLM_KV_CACHE_LAYOUT=LBHNC (vLLM 0.29+) or HND (older)")
    if KV in size and size[KV] != 2:
        raise UnsupportedKVLayout(f"KV cache {name}: the K/V dimension has {size[KV]} entries, not 2")
    kernel_tokens, kernels = size[TOKENS], size[BLOCKS]
    if g.block_tokens % kernel_tokens or kernels % (g.block_tokens // kernel_tokens):
        raise UnsupportedKVLayout(
            f"KV cache {name}: blocks of {kernel_tokens} tokens do not tile the scheduler's blocks of "
            f"{g.block_tokens}; use a --block-size that is a multiple of the attention kernel's")
    split = g.block_tokens // kernel_tokens
    heads = size.get(HEADS, 1)
    try:
        first_head, expected = rank_heads(g.tp_rank, g.tp_size, g.total_heads) if g.total_heads \
            else (g.tp_rank * heads, heads)
    except PlanError as exc:
        raise UnsupportedKVLayout(str(exc)) from None
    if heads != expected:
        raise UnsupportedKVLayout(
            f"KV cache {name} holds {heads} heads per rank where {g.total_heads} KV heads over TP "
            f"{g.tp_size} give {expected}; a quantised KV cache that stores K and V as separate heads "
            "(e.g. nvfp4) cannot be transferred: use --kv-cache-dtype auto")
    device = getattr(tensor.device, "index", None)
    planes = [("", 0)] if KV not in size else [(".k", 0), (".v", stride[KV])]
    return [Region(
        name=name + suffix, base_addr=tensor.data_ptr() + offset,
        block_stride_bytes=split * stride[BLOCKS], num_blocks=kernels // split, heads=heads,
        first_head=first_head, head_bytes=size[HEAD] * elem, block_tokens=g.block_tokens,
        head_stride_bytes=stride.get(HEADS, 0), token_stride_bytes=stride[TOKENS],
        kernel_block_tokens=kernel_tokens if split > 1 else 0,
        kernel_stride_bytes=stride[BLOCKS] if split > 1 else 0,
        device_id=device if device is not None else 0) for suffix, offset in planes]


@dataclass(frozen=True)
class LayerGroups:
    """Consecutive layers in ``groups`` groups of near-equal size, for streaming by layers: each
    layer name (as vLLM's ``save_kv_layer`` names it) and each region to its group. Layers with no
    region of their own (vLLM's KV sharing: they write none) belong to no group."""

    group_of_layer: dict[str, int]
    group_of_region: tuple[int, ...]
    groups: int


def layer_groups(layer_names: list[str], regions: tuple[Region, ...], max_groups: int) -> LayerGroups:
    """``layer_names`` in ``kv_caches`` order, which is the order the forward runs them."""
    layer_of = {name + suffix: name for name in layer_names for suffix in ("", ".k", ".v")}
    owning = list(dict.fromkeys(layer_of[r.name] for r in regions))
    groups = max(1, min(max_groups, len(owning)))
    group_of_layer = {name: i * groups // len(owning) for i, name in enumerate(owning)}
    return LayerGroups(group_of_layer, tuple(group_of_layer[layer_of[r.name]] for r in regions), groups)


def dims_from_probe(declared_shape: tuple[int, ...], probe: Mapping[str, int]) -> tuple[str, ...]:
    """Label each dimension of a shape a backend declared for distinct probe values
    (``num_blocks``, ``block_size``, ``num_kv_heads``, ``head_size``); K and V packed into one
    head dimension show as twice ``head_size``."""
    labels = {probe["num_blocks"]: BLOCKS, probe["block_size"]: TOKENS, probe["num_kv_heads"]: HEADS,
              probe["head_size"]: HEAD, 2 * probe["head_size"]: HEAD, 2: KV}
    if len(labels) != 6:
        raise ValueError(f"probe values {dict(probe)} are not distinct")
    dims = tuple(labels.get(n, f"?{n}") for n in declared_shape)
    if any(d.startswith("?") for d in dims) or len(set(dims)) != len(dims):
        raise PlanError(f"declared KV shape {declared_shape} for {dict(probe)} has dimensions that are "
                        "not blocks, tokens, heads, a head or K/V")
    return dims


def staging_rows(described: list[tuple[Region, Any]]) -> list[Any]:
    """``block_rows`` of every described region, in order (what ``HostStaging`` copies)."""
    return [block_rows(tensor, region) for region, tensor in described]


def block_rows(tensor: Any, region: Region) -> Any:
    """A region's blocks as rows of bytes (a ``(num_blocks, row)`` uint8 view of the same memory),
    for host staging; only where a block's chunks fill one dense span."""
    import torch

    row = region.extent_bytes - (region.num_blocks - 1) * region.block_stride_bytes
    if row != region.block_bytes:
        raise UnsupportedKVLayout(
            f"KV cache {region.name}: a block's bytes are spread out (layout {region.layout}, heads or "
            "layers outside blocks), so it cannot be staged through host memory; set "
            "VLLM_KV_CACHE_LAYOUT=LBHNC or host_staging: never")
    storage = tensor.untyped_storage()  # every byte of it, as a flat uint8 tensor on its device
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))
    return torch.as_strided(flat, (region.num_blocks, row), (region.block_stride_bytes, 1),
                            region.base_addr - flat.data_ptr())
