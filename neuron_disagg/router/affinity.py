"""How many leading blocks of a prompt each instance already holds: from the instance's own KV events
where it publishes them, otherwise from this router's history of what it sent there.

``flows.py`` asks ``hits`` once per request (the prompt's chain from ``keys``) and tells
``routed`` where each leg went and ``leg_ended`` when it ended; ``kv_events.py`` hands every
published message to ``received``. ``selection.py`` weighs the hits against load.

Per instance, the source is:

- ``events`` once its publisher has been heard, until it falls silent while working: a leg of ours
  ended on it more than ``events_stale_s`` after its last batch (each prefill stores blocks, so a
  working instance publishes). The blocks its events fed are then forgotten.
- ``history`` otherwise: the chains of the prompts this router sent it within ``history_ttl_s``.
  Its cache may have evicted them, or hold more (another router's requests); it is a guess.

A publisher that restarts (its sequence numbers start again) held nothing before: its blocks are
forgotten with it. Messages from a topic that names no instance in the pool are rejected and
counted, so no sender can grow the index with instances of its own invention.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .prefix_index import PrefixIndex

#: Blocks remembered per instance, from its events and from history each: more than a pool holds
#: (an H200 holding a 32B model's KV has some 25,000 blocks of 16 tokens), and a bound on what a
#: flood of events or requests can make the router keep (about 150 bytes a block).
MAX_BLOCKS = 200_000

Source = Literal["events", "history"]
SOURCES: tuple[Source, ...] = ("events", "history")


@dataclass
class _Heard:
    """One instance's publisher and this router's history of it."""

    last_batch_at: float | None = None   # monotonic; None: never heard
    last_seq: int = -1
    worked_at: float = 0.0               # a leg of ours last ended on it
    history: OrderedDict[bytes, float] = field(default_factory=OrderedDict)  # chain key -> expiry


class Affinity:
    def __init__(self, block_size: int, *, events_stale_s: float = 10.0, history_ttl_s: float = 300.0,
                 max_blocks: int = MAX_BLOCKS):
        self.index = PrefixIndex(block_size, max_blocks)
        self.events_stale_s, self.history_ttl_s, self.max_blocks = events_stale_s, history_ttl_s, max_blocks
        self._heard: dict[str, _Heard] = {}
        #: messages not applied, by reason: "unknown_topic", "bad_frames" (not [topic, 8-byte seq,
        #: payload]), and what the index rejected inside a batch (``PrefixIndex.rejected``)
        self.rejected: Counter[str] = Counter()
        self.restarts: Counter[str] = Counter()   # publishers heard starting over, by instance
        self.missed: Counter[str] = Counter()     # batches skipped in a publisher's sequence, by instance

    @property
    def block_size(self) -> int:
        return self.index.block_size

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.index.keys_of(token_ids)

    # -- what instances publish -------------------------------------------------------------------
    def received(self, frames: Sequence[bytes], known: set[str], now: float) -> str | None:
        """One message off the events socket: [topic (the instance's URL), seq, payload]. ``known``:
        the pool's URLs. Returns the instance it came from, None if rejected."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.rejected["bad_frames"] += 1
            return None
        url = frames[0].decode("utf-8", "replace").rstrip("/")
        if url not in known:
            self.rejected["unknown_topic"] += 1
            return None
        heard = self._heard.setdefault(url, _Heard())
        seq = int.from_bytes(frames[1], "big")
        if seq <= heard.last_seq:  # numbered from 0 again: a new process, an empty cache
            self.index.forget(url)
            self.restarts[url] += 1
        elif heard.last_seq >= 0 and seq > heard.last_seq + 1:
            self.missed[url] += seq - heard.last_seq - 1
        heard.last_seq = seq
        if heard.last_batch_at is None or not self._events_live(heard):
            self.index.forget(url)  # heard again after falling silent: what it said before is stale
        heard.last_batch_at = now
        self.index.apply(url, frames[2])
        return url

    def forget(self, url: str) -> None:
        """An instance removed from the pool, or restarted: nothing it held is known."""
        self._heard.pop(url, None)
        self.index.forget(url)

    # -- what this router sends -------------------------------------------------------------------
    def routed(self, url: str, keys: Sequence[bytes], now: float) -> None:
        """A leg with this prompt went to ``url``: it will hold these blocks for a while."""
        if not keys:
            return
        history = self._heard.setdefault(url, _Heard()).history
        expiry = now + self.history_ttl_s
        for key in keys:
            history[key] = expiry
            history.move_to_end(key)
        while len(history) > self.max_blocks:
            history.popitem(last=False)

    def leg_ended(self, url: str, now: float) -> None:
        heard = self._heard.get(url)
        if heard is not None:
            heard.worked_at = now

    # -- what a prompt would hit ------------------------------------------------------------------
    def source(self, url: str) -> Source:
        heard = self._heard.get(url)
        return "events" if heard is not None and self._events_live(heard) else "history"

    def hit_blocks(self, url: str, keys: Sequence[bytes], now: float) -> int:
        heard = self._heard.get(url)
        if heard is None or not keys:
            return 0
        if self._events_live(heard):
            return self.index.hit_blocks(url, keys)
        if heard.last_batch_at is not None and self.index.blocks(url):
            self.index.forget(url)  # its events stopped: what they said expires now
        history, n = heard.history, 0
        while history and next(iter(history.values())) <= now:  # oldest first: expire from the front
            history.popitem(last=False)
        for key in keys:
            if key not in history:
                break
            n += 1
        return n

    def _events_live(self, heard: _Heard) -> bool:
        return heard.last_batch_at is not None and heard.worked_at - heard.last_batch_at <= self.events_stale_s
