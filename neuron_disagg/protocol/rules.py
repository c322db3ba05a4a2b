"""One row of a state table: what an event does in a state. Every table of the protocol (the four
transfer sides', and the peer watch's) is a dict of these, keyed by (state, event)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S")
F = TypeVar("F")


@dataclass(frozen=True)
class Rule(Generic[S, F]):
    """``next_state`` None means: stay. ``reason`` overrides the event's reason for effects."""

    next_state: S | None
    effects: tuple[F, ...] = ()
    reason: str | None = None
