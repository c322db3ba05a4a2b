"""What the transfer threads report to the engine: the mirror of ``inbox.py``.

A thread puts one record per result (a load landed, a load will never come, blocks are back); the
engine loop drains them once per step, in the order they happened, and turns them into what vLLM
understands. Nothing here calls back into the engine from a transfer thread, so no engine state is
touched off the engine loop and nothing needs a lock but the outbox's own.

An engine step that computes nothing may ``wait`` briefly for the next result (D's landing wait).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from ..protocol.messages import TransferId


@dataclass(frozen=True, slots=True)
class Loaded:
    """D: the KV of this transfer is in our blocks."""

    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class Failed:
    """D: the KV of this transfer will not come (``Freed`` follows once its blocks are fenced)."""

    transfer_id: TransferId
    reason: str


@dataclass(frozen=True, slots=True)
class Quarantined:
    """D: the KV of this transfer will not come and the request goes on without it now; its blocks
    stay out of use (a late write may land in them) until ``Freed``."""

    transfer_id: TransferId
    reason: str


@dataclass(frozen=True, slots=True)
class Freed:
    """Either side: the threads are done with these blocks (P: sent or given up; D: fenced)."""

    transfer_id: TransferId
    block_ids: tuple[int, ...]


Result = Loaded | Failed | Quarantined | Freed


class Outbox:
    def __init__(self) -> None:
        self._results: deque[Result] = deque()
        self._arrived = threading.Condition(threading.Lock())

    def put(self, result: Result) -> None:
        """Any transfer thread."""
        with self._arrived:
            self._results.append(result)
            self._arrived.notify_all()

    def __bool__(self) -> bool:
        """Whether a result is waiting (a read without the lock: a hint, as any such read is)."""
        return bool(self._results)

    def drain(self) -> list[Result]:
        """The engine loop, each step: every result since the last drain, oldest first."""
        if not self._results:  # most steps: no lock taken
            return []
        with self._arrived:
            results = list(self._results)
            self._results.clear()
        return results

    def wait(self, timeout_s: float) -> bool:
        """Until a result is waiting, ``timeout_s`` passed or ``wake`` was called; whether one is."""
        with self._arrived:
            if not self._results:
                self._arrived.wait(timeout_s)
            return bool(self._results)

    def wake(self) -> None:
        """Ends every ``wait`` now (a reader that is stopping)."""
        with self._arrived:
            self._arrived.notify_all()

    def take(self, timeout_s: float) -> list[Result]:
        """What a process that reports results as they come (the test peer) reads: at least one
        result, or none after ``timeout_s``."""
        return self.drain() if self.wait(timeout_s) else []
