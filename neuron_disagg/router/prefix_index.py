"""What each instance holds in its prefix cache, from vLLM's KV events, and how many leading blocks
of a prompt each one would hit. Pure: event bytes and token ids in, matches out; whatever receives
the events and whatever chooses by the matches live elsewhere.

vLLM's own block hashes are seeded and their algorithm is a per-deployment flag, so the index does
not recompute them. It keys each block by a chain of its own over the token ids that BlockStored
carries (a block's key digests its parent's key and its own tokens), and keeps, per instance,
vLLM's hash -> that key, so that BlockRemoved (hashes only) and later parents find it. A prompt's
token ids give the same chain (``keys_of``), and an instance's hit is the run of leading keys it
holds (``hit_blocks``).

The events are decoded with our own msgspec types, which read what vLLM's publisher writes (the
tests encode with vLLM's classes, version by version). A batch that does not decode, or whose
blocks do not add up, is rejected and counted, and so is each event of a kind we do not know; no
sender can grow the index past ``max_blocks`` keys per instance (the oldest stored go first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

VllmHash = bytes | int  # vLLM's ExternalBlockHash


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[object] | None = None  # multimodal items, cache salts: part of vLLM's hash, not of ours
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[VllmHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]  # one by one: an event of a kind we do not know skips itself, not the batch
    data_parallel_rank: int | None = None


class _MappedBatch(EventBatch, array_like=False):
    """vLLM after 0.34 writes a batch as a map, not an array."""


_Event = BlockStored | BlockRemoved | AllBlocksCleared
_decode_batch = msgspec.msgpack.Decoder(EventBatch).decode
_decode_mapped_batch = msgspec.msgpack.Decoder(_MappedBatch).decode
_decode_event = msgspec.msgpack.Decoder(_Event).decode

#: Most blocks one BlockStored may carry: vLLM sends a step's new blocks of one request; a longer
#: list is not from vLLM.
MAX_BLOCKS_PER_EVENT = 65_536


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """One block's key: its parent's key (b"" for a prompt's first block) and its token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class _Held:
    """One instance's blocks: vLLM's hash -> our key, and our keys in the order they were stored."""

    by_hash: dict[VllmHash, bytes] = field(default_factory=dict)
    keys: dict[bytes, VllmHash] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self, block_size: int, max_blocks: int = 1_000_000):
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be positive")
        self.block_size, self.max_blocks = block_size, max_blocks
        self._held: dict[str, _Held] = {}
        #: what was not taken, by reason: "malformed" (a batch that does not decode), "unknown_event",
        #: "bad_event" (blocks that do not add up, the wrong block size), "unknown_parent" (a chain
        #: begun before this index listened), "not_indexed" (LoRA, multimodal or salted blocks,
        #: another medium or KV group: keyed by more than tokens)
        self.rejected: Counter[str] = Counter()

    def apply(self, instance: str, payload: bytes) -> int:
        """One published batch from ``instance``; returns the events applied."""
        try:
            batch = _decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            try:
                batch = _decode_mapped_batch(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.rejected["malformed"] += 1
                return 0
        held = self._held.setdefault(instance, _Held())
        applied = 0
        for raw in batch.events:
            try:
                event = _decode_event(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.rejected["unknown_event"] += 1
                continue
            if isinstance(event, AllBlocksCleared):
                held.by_hash.clear()
                held.keys.clear()
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    key = held.by_hash.pop(h, None)
                    if key is not None:
                        held.keys.pop(key, None)
            elif not self._stored(held, event):
                continue
            applied += 1
        return applied

    def _stored(self, held: _Held, event: BlockStored) -> bool:
        n = len(event.block_hashes)
        if (event.block_size != self.block_size or not 0 < n <= MAX_BLOCKS_PER_EVENT
                or len(event.token_ids) != n * self.block_size):
            self.rejected["bad_event"] += 1
            return False
        if (event.lora_id is not None or event.lora_name is not None
                or any(k is not None for k in event.extra_keys or ())  # one entry per block, None if none
                or event.medium not in (None, "GPU") or event.group_idx not in (None, 0)):
            self.rejected["not_indexed"] += 1
            return False
        parent = b"" if event.parent_block_hash is None else held.by_hash.get(event.parent_block_hash)
        if parent is None:
            self.rejected["unknown_parent"] += 1
            return False
        size = self.block_size
        for i, h in enumerate(event.block_hashes):
            parent = chain_key(parent, event.token_ids[i * size:(i + 1) * size])
            old = held.by_hash.get(h)
            if old is not None:
                held.keys.pop(old, None)
            held.by_hash[h] = parent
            held.keys[parent] = h
        while len(held.keys) > self.max_blocks:
            oldest = next(iter(held.keys))
            held.by_hash.pop(held.keys.pop(oldest), None)
        return True

    def keys_of(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chain of a prompt's full blocks (vLLM caches no partial block)."""
        keys, parent, size = [], b"", self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = chain_key(parent, token_ids[start:start + size])
            keys.append(parent)
        return keys

    def hit_blocks(self, instance: str, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, ``instance`` holds."""
        held = self._held.get(instance)
        if held is None:
            return 0
        n = 0
        for key in keys:
            if key not in held.keys:
                break
            n += 1
        return n

    def blocks(self, instance: str) -> int:
        held = self._held.get(instance)
        return 0 if held is None else len(held.keys)

    def forget(self, instance: str) -> None:
        """Everything ``instance`` was said to hold (its publisher restarted, its events stopped)."""
        self._held.pop(instance, None)
