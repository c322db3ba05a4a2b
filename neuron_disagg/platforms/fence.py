"""How the writer thread knows the KV of a step is really in device memory before it posts a WRITE.

The engine's forward loop only *records* a fence (cheap, never blocks, invariant I5); the writer
thread *waits* on it just before issuing the NIXL WRITE. Without it, an asynchronous accelerator may
still be computing the KV when the NIC reads it, and D decodes from half-written blocks.
"""

from __future__ import annotations

from typing import Any, Protocol
from collections.abc import Callable, Mapping


class KVFence(Protocol):
    def ready(self) -> bool:
        """True once the KV is in memory (never blocks)."""

    def wait(self) -> None:
        """Block the calling (writer) thread until the KV is in memory."""


class ReadyFence:
    """CPU: the forward pass is synchronous, so the KV is in memory as soon as the step returns."""

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class EventFence:
    """A recorded device event (``torch.cuda.Event``): ``query`` polls it, ``synchronize`` waits."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def ready(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class CallbackFence:
    """A wait expressed as a callable, run once on the writer thread (Neuron's device-ops wait)."""

    def __init__(self, wait_fn: Callable[[], None]) -> None:
        self._wait_fn = wait_fn
        self._done = False

    def ready(self) -> bool:
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._wait_fn()
            self._done = True


class LayerFences:
    """One step's KV, group of layers by group: where vLLM calls ``save_kv_layer`` after each
    attention layer wrote its KV, the engine thread counts the group's layers off (``saved``) and
    records a fence when the group, and every group before it, is complete; the writer thread posts a
    group's part of a write once that fence is ready (``ready``). Layers run in the same order every
    step, so groups are runs of consecutive layers, and a fence recorded after group g covers groups
    0..g. ``finish``, after the forward, fences whatever no hook reached (a layer without the hook, a
    backend that calls none): a write waits at most for the step. The engine thread only appends and
    assigns; the writer only reads, which is safe across threads in CPython without a lock."""

    def __init__(self, group_of_layer: Mapping[str, int], group_of_region: tuple[int, ...], groups: int,
                 record: Callable[[], KVFence], on_fenced: Callable[[], None] = lambda: None):
        self.group_of_layer, self.groups = group_of_layer, groups
        self.group_of_region = group_of_region  # the writer parts its plans by these (plan.split_by_group)
        self._record = record
        self._on_fenced = on_fenced  # wakes the writer: a queue put
        self._left = [0] * groups
        for g in group_of_layer.values():
            self._left[g] += 1
        self._fences: list[KVFence | None] = [None] * groups
        self._next = 0  # the first group not yet fenced

    def saved(self, layer_name: str) -> None:
        """Engine thread, from ``save_kv_layer``: ``layer_name`` wrote its KV for this step."""
        g = self.group_of_layer.get(layer_name)
        if g is None:
            return
        self._left[g] -= 1
        if self._next < self.groups and self._left[self._next] <= 0:
            while self._next < self.groups and self._left[self._next] <= 0:
                self._fences[self._next] = self._record()
                self._next += 1
            self._on_fenced()

    def finish(self, fence: KVFence) -> int:
        """Engine thread, after the forward: ``fence`` (recorded behind it) covers every group left.
        Returns how many groups the hook had fenced (all of them where vLLM calls it every layer)."""
        hooked = self._next
        for g in range(self._next, self.groups):
            self._fences[g] = fence
        self._next = self.groups
        if hooked < self.groups:
            self._on_fenced()
        return hooked

    def ready(self, group: int) -> bool:
        """Writer thread: the KV of ``group``'s layers is in memory (never blocks)."""
        fence = self._fences[group]
        return fence is not None and fence.ready()

    def on_device(self) -> bool:
        """Writer thread: a group's fence is recorded and not passed yet: worth polling for."""
        return any(f is not None and not f.ready() for f in self._fences)

    def passed(self) -> bool:
        """Writer thread: the whole step's KV is in memory."""
        return self.ready(self.groups - 1)
