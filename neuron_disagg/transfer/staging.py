"""Host staging: KV moves through host memory when NIXL cannot register the device's.

Some Neuron runtimes cannot register device memory with NIXL. There each rank registers a host copy
of its KV layout instead — the same regions, ``slots`` blocks deep — and the transfer threads copy
blocks across: P's writer copies finished blocks to slots (then the engine may free them at once)
and writes from the slots; D registers slots with P and, once P's write landed, copies them into
the blocks the engine allocated. The protocol never knows: it plans with slot numbers in the
staging regions exactly as it would with block numbers in the device regions.

The copies use torch on the KV tensors vLLM gave us, so the same code runs on CPU tensors (tested
here) and on XLA device tensors (Neuron; not verified here). Slots are few: a transfer that finds
none waits, FIFO, until an earlier one gives its slots back.
"""

from __future__ import annotations

from collections import deque
from msgspec.structs import replace
from typing import Any, Callable, Sequence

from ..protocol.messages import Region, TransferId


class HostStaging:
    """Host slots mirroring the device regions. Owned by one transfer thread."""

    def __init__(self, views: Sequence[Any], regions: Sequence[Region], slots: int):
        """``views[i]``: a tensor whose first dimension is the blocks of ``regions[i]``."""
        import torch

        if len(views) != len(regions):
            raise ValueError(f"{len(views)} KV views for {len(regions)} regions")
        self.slots = max(1, slots)
        self._views = list(views)
        self._host = [torch.zeros((self.slots, r.block_stride_bytes), dtype=torch.uint8) for r in regions]
        self.regions = tuple(replace(r, base_addr=h.data_ptr(), num_blocks=self.slots)
                             for r, h in zip(regions, self._host))
        self._free: deque[int] = deque(range(self.slots))
        self._waiting: deque[tuple[int, Callable[[tuple[int, ...]], None]]] = deque()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self, count: int, then: Callable[[tuple[int, ...]], None]) -> None:
        """Call ``then(slots)`` with ``count`` slots: now, or once enough were given back (FIFO, so
        a large transfer is not starved by small ones)."""
        if count > self.slots:
            raise ValueError(f"a transfer of {count} blocks can never fit {self.slots} staging slots: "
                             "raise host_staging_blocks")
        self._waiting.append((count, then))
        self._serve()

    def give_back(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)
        self._serve()

    def cancel_waiting(self) -> list[Callable[[tuple[int, ...]], None]]:
        """Forget every transfer still waiting for slots (shutdown); returns their callbacks."""
        waiting = [then for _, then in self._waiting]
        self._waiting.clear()
        return waiting

    def _serve(self) -> None:
        while self._waiting and self._waiting[0][0] <= len(self._free):
            count, then = self._waiting.popleft()
            then(tuple(self._free.popleft() for _ in range(count)))

    # -- copies (on the owning transfer thread) -------------------------------------------------------
    def to_host(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Device blocks -> host slots."""
        import torch

        for view, host in zip(self._views, self._host):
            index = torch.tensor(list(blocks), dtype=torch.long, device=view.device)
            data = view.index_select(0, index).cpu().contiguous()
            host[list(slots)] = data.view(torch.uint8).reshape(len(slots), -1)

    def to_device(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Host slots -> device blocks."""
        import torch

        for view, host in zip(self._views, self._host):
            data = host[list(slots)].view(view.dtype).reshape(len(slots), *view.shape[1:])
            index = torch.tensor(list(blocks), dtype=torch.long, device=view.device)
            view.index_copy_(0, index, data.to(view.device))


class StagedTransfers:
    """Which slots stand for which device blocks, per transfer."""

    def __init__(self) -> None:
        self._by_transfer: dict[TransferId, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def add(self, tid: TransferId, blocks: tuple[int, ...], slots: tuple[int, ...]) -> None:
        self._by_transfer[tid] = (blocks, slots)

    def pop(self, tid: TransferId) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(device blocks, slots) of ``tid``, forgotten."""
        return self._by_transfer.pop(tid, None)

    def get(self, tid: TransferId) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        return self._by_transfer.get(tid)


def kv_views(kv_caches: dict[str, Any]) -> list[Any]:
    """One block-major tensor per region, in ``regions_from_kv_caches`` order."""
    views = []
    for tensor in kv_caches.values():
        views.extend([tensor] if tensor.dim() == 4 else [tensor[0], tensor[1]])
    return views
