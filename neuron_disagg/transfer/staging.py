"""Host staging: KV moves through host memory when NIXL cannot register the device's.

Some Neuron runtimes cannot register device memory with NIXL. There each rank registers a host copy
of its KV layout instead — the same regions, ``slots`` blocks deep — and the transfer threads copy
blocks across: P's writer copies finished blocks to slots (then the engine may free them at once)
and writes from the slots; D registers slots with P and, once P's write landed, copies them into
the blocks the engine allocated. The protocol never knows: it plans with slot numbers in the
staging regions exactly as it would with block numbers in the device regions.

The copies use torch on the KV tensors vLLM gave us, so the same code runs on CPU tensors (tested
here) and on XLA device tensors (Neuron; not verified here). Slots are few: a transfer that finds
none waits, first come first served, until an earlier one gives its slots back.
"""

from __future__ import annotations

from collections import deque
from msgspec.structs import replace
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

from ..protocol.messages import Region, TransferId

if TYPE_CHECKING:  # imported where used: this module loads without torch
    import torch


class HostStaging:
    """Host slots mirroring the device regions, and which transfer holds which. Owned by one
    transfer thread: it takes slots for a transfer's blocks, and releases or withdraws them."""

    def __init__(self, rows: Sequence[Any], regions: Sequence[Region], slots: int):
        """``rows[i]``: ``regions[i]``'s blocks as a ``(blocks, bytes)`` uint8 view of the KV
        (``platforms.kv_layout.block_rows``); a slot holds one such row, laid out as the block."""
        import torch

        if len(rows) != len(regions):
            raise ValueError(f"{len(rows)} KV views for {len(regions)} regions")
        self.slots = max(1, slots)
        self._views = list(rows)
        self._host = [torch.zeros((self.slots, row.shape[1]), dtype=torch.uint8) for row in rows]
        self.regions = tuple(replace(r, base_addr=h.data_ptr(), num_blocks=self.slots,
                                     block_stride_bytes=h.shape[1]) for r, h in zip(regions, self._host, strict=True))
        self._free: deque[int] = deque(range(self.slots))
        # transfer -> (the engine's blocks, what to call with the slots), first come first served
        self._waiting: dict[TransferId, tuple[tuple[int, ...], Callable[[tuple[int, ...]], None]]] = {}
        self._held: dict[TransferId, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # -> (blocks, slots)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self, tid: TransferId, blocks: tuple[int, ...], then: Callable[[tuple[int, ...]], None]) -> None:
        """Call ``then(slots)``, one slot per block: now, or once enough were given back (in order
        of asking, so a large transfer is not starved by small ones)."""
        if len(blocks) > self.slots:
            raise ValueError(f"a transfer of {len(blocks)} blocks can never fit {self.slots} staging slots: "
                             "raise host_staging_blocks")
        self._waiting[tid] = (tuple(blocks), then)
        self._serve()

    def held(self, tid: TransferId) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(the engine's blocks, their slots) of a transfer holding slots."""
        return self._held.get(tid)

    def release(self, tid: TransferId) -> tuple[int, ...] | None:
        """The transfer's slots go back; returns its engine blocks (None: it held none)."""
        held = self._held.pop(tid, None)
        if held is None:
            return None
        # Kept in order, so the next transfer gets a run of neighbouring slots: runs copy as
        # slices, scattered slots by index at a fraction of the speed (see the copies below).
        self._free = deque(sorted((*self._free, *held[1])))
        self._serve()
        return held[0]

    def withdraw(self, tid: TransferId) -> tuple[int, ...] | None:
        """Forget a transfer still waiting for slots; returns its engine blocks (None: not waiting)."""
        waiting = self._waiting.pop(tid, None)
        return None if waiting is None else waiting[0]

    def withdraw_all(self) -> list[tuple[TransferId, tuple[int, ...]]]:
        """Forget every waiting transfer (shutdown): (transfer, engine blocks) of each."""
        waiting = [(tid, blocks) for tid, (blocks, _) in self._waiting.items()]
        self._waiting.clear()
        return waiting

    def _serve(self) -> None:
        while self._waiting:
            tid, (blocks, then) = next(iter(self._waiting.items()))
            if len(blocks) > len(self._free):
                return
            del self._waiting[tid]
            slots = tuple(self._free.popleft() for _ in blocks)
            self._held[tid] = (blocks, slots)
            then(slots)

    # -- copies (on the owning transfer thread) -------------------------------------------------------
    # Contiguous runs of blocks and slots move as slices (memcpy on CPU, one DMA each on a device);
    # a scattered list moves by index, over 8-byte words where the tensor is on the CPU (torch's
    # CPU index kernels go element by element: bf16 rows moved at 0.3 GiB/s here, int64 rows at 2).
    def to_host(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Device blocks -> host slots."""
        runs = _runs(blocks, slots)
        for view, host in zip(self._views, self._host, strict=True):
            if len(runs) <= _MAX_RUNS:
                for block, slot, n in runs:
                    host[slot:slot + n].copy_(view[block:block + n])
            elif view.device.type == "cpu":
                _words(host).index_copy_(0, _index(slots), _words(view).index_select(0, _index(blocks)))
            else:
                host.index_copy_(0, _index(slots), view.index_select(0, _index(blocks, view.device)).cpu())

    def to_device(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Host slots -> device blocks."""
        runs = _runs(blocks, slots)
        for view, host in zip(self._views, self._host, strict=True):
            if len(runs) <= _MAX_RUNS:
                for block, slot, n in runs:
                    view[block:block + n].copy_(host[slot:slot + n])
            elif view.device.type == "cpu":
                _words(view).index_copy_(0, _index(blocks), _words(host).index_select(0, _index(slots)))
            else:
                view.index_copy_(0, _index(blocks, view.device), host.index_select(0, _index(slots)).to(view.device))


_MAX_RUNS = 16


def _runs(blocks: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first block, first slot, length) of each stretch where both go up by one."""
    runs: list[list[int]] = []
    for block, slot in zip(blocks, slots, strict=True):
        if runs and block == runs[-1][0] + runs[-1][2] and slot == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([block, slot, 1])
    return [(block, slot, n) for block, slot, n in runs]


def _index(ids: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    import torch

    return torch.tensor(list(ids), dtype=torch.long, device=device)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """Byte rows as 8-byte words where their width, stride and start allow it (torch's CPU index
    kernels go element by element: bf16 rows moved at 0.3 GiB/s here, int64 rows at 2)."""
    import torch

    if rows.shape[1] % 8 or rows.stride(0) % 8 or rows.storage_offset() % 8:
        return rows
    return rows.view(torch.int64)
