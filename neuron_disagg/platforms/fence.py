"""How the writer thread knows the KV of a step is really in device memory before it posts a WRITE.

The engine's forward loop only *records* a fence (cheap, never blocks, invariant I5); the writer
thread *waits* on it just before issuing the NIXL WRITE. Without it, an asynchronous accelerator may
still be computing the KV when the NIC reads it, and D decodes from half-written blocks.
"""

from __future__ import annotations

from typing import Any, Protocol
from collections.abc import Callable


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
