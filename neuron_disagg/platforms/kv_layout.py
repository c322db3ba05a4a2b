"""Describe vLLM's KV cache tensors as block-major regions, read off the tensors themselves.

Two shapes are understood; anything else fails at startup with the shape in the message:

- ``(num_blocks, heads, block_tokens, channels)`` — one tensor per layer holding K and V (vLLM's
  CPU backend packs K and V of one head and block together): one HND region per layer whose
  "head bytes" are ``channels * element size``. The bytes inside a head's span are opaque; both
  sides must use the same packing, which the same vLLM build on the same CPU kind guarantees.
- ``(2, num_blocks, block_tokens, heads, head_dim)`` — K and V planes (the common GPU layout):
  two NHD regions per layer.
"""

from __future__ import annotations

from typing import Mapping

from ..protocol.messages import Region


class UnsupportedKVLayout(ValueError):
    pass


def regions_from_kv_caches(kv_caches: Mapping[str, "object"], tp_rank: int, device_id: int = 0) -> tuple[Region, ...]:
    regions = []
    for name, tensor in kv_caches.items():
        if not tensor.is_contiguous():
            raise UnsupportedKVLayout(f"KV cache {name} is not contiguous (strides {tuple(tensor.stride())})")
        elem = tensor.element_size()
        shape = tuple(tensor.shape)
        if len(shape) == 4:
            blocks, heads, tokens, channels = shape
            regions.append(Region(
                name=name, base_addr=tensor.data_ptr(), block_stride_bytes=tensor.stride(0) * elem,
                num_blocks=blocks, heads=heads, first_head=tp_rank * heads, head_bytes=channels * elem,
                block_tokens=tokens, layout="HND", device_id=device_id))
        elif len(shape) == 5 and shape[0] == 2:
            _, blocks, tokens, heads, head_dim = shape
            for i, kv in enumerate("kv"):
                plane = tensor[i]
                regions.append(Region(
                    name=f"{name}.{kv}", base_addr=plane.data_ptr(), block_stride_bytes=plane.stride(0) * elem,
                    num_blocks=blocks, heads=heads, first_head=tp_rank * heads, head_bytes=head_dim * elem,
                    block_tokens=tokens, layout="NHD", device_id=device_id))
        else:
            raise UnsupportedKVLayout(
                f"KV cache {name} has shape {shape}; neuron-disagg understands (blocks, heads, tokens, "
                "channels) and (2, blocks, tokens, heads, head_dim)")
    return tuple(regions)
