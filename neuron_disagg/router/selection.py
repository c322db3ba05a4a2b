"""Which instance gets the next leg: by load and by what it already holds, never round robin.

Called by ``InstancePool.pick`` with the healthy candidates and, where the router knows the prompt,
``Hits``: how many of its tokens each one holds (``affinity.py``). Pure functions of the instances'
counters, so tests can check the choice without servers.

What an instance holds may pull a leg to it only while that keeps it within ``(1 + epsilon)`` times
the mean load, counting the leg (bounded loads, as in consistent hashing). The load is the larger
of what runs there now and the legs sent there within ``window_s``: at light load nothing runs for
long, and a bound on what runs alone would let one hot prefix take every request. With both, a hot
prefix fills its holder to the bound and spills to the next, which comes to hold it too. Without
hits the choice is the load-only one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .instances import Instance


@dataclass(frozen=True)
class Hits:
    """A prompt's tokens, and how many of them, from the first, an instance holds."""

    tokens: int
    held: Callable[[Instance], int]
    epsilon: float
    window_s: float = 30.0  # RouterSettings.affinity_window_s's default


def within_bound(candidates: list[Instance], load: Callable[[Instance], float], epsilon: float) -> set[Instance]:
    """The candidates that can take one more leg and stay within (1 + epsilon) x the mean load with it
    (never empty: the least loaded always can)."""
    cap = math.ceil((1 + epsilon) * (sum(load(i) for i in candidates) + 1) / len(candidates))
    return {i for i in candidates if load(i) + 1 <= cap}


def pick_prefill(candidates: list[Instance], hits: Hits | None = None, now: float = 0.0) -> Instance:
    """P's cost is prefill compute, which grows with the prompt tokens it must compute: pick the P
    with the fewest such tokens outstanding, this prompt's not held there included, among those
    within the load bound; then the fewest legs, then the one picked longest ago (so equal
    instances take turns)."""
    if hits is None:
        return min(candidates, key=lambda i: (i.prompt_tokens, i.in_flight, i.last_picked))
    bounded = within_bound(candidates, lambda i: max(i.in_flight, i.picked_within(now, hits.window_s)), hits.epsilon)
    return min(candidates, key=lambda i: (i not in bounded, i.prompt_tokens + hits.tokens - hits.held(i),
                                          i.in_flight, i.last_picked))


def decode_running(inst: Instance, now: float, metrics_stale_s: float) -> float:
    """Sequences D is running: the router's own open legs (fresh, but blind to other routers) or
    D's own count from its last /metrics scrape (complete, but up to one interval old), the larger."""
    running = float(inst.in_flight)
    engine = inst.engine
    if engine is not None and now - engine.at <= metrics_stale_s:
        running = max(running, engine.running + engine.waiting)
    return running


def pick_decode(candidates: list[Instance], now: float, metrics_stale_s: float,
                kv_cache_full_fraction: float, silent_s: float = 1.0, hits: Hits | None = None) -> Instance:
    """D's cost is decode batch size and KV memory. Picked last: a D gone silent (``Instance.silent``:
    stopped or hung, not yet ejected), then one whose KV cache is nearly full (its new requests would
    wait for blocks). Then, within the load bound, the one holding most of the prompt (its transfer
    is only the rest, and so are the blocks it allocates); then the fewest running sequences, the
    lowest KV usage, the one picked longest ago."""
    bounded = (set(candidates) if hits is None else within_bound(
        candidates, lambda i: max(decode_running(i, now, metrics_stale_s), i.picked_within(now, hits.window_s)),
        hits.epsilon))

    def key(inst: Instance) -> tuple[bool, bool, bool, int, float, float, int]:
        engine = inst.engine
        fresh = engine is not None and now - engine.at <= metrics_stale_s
        usage = engine.kv_cache_usage if fresh and engine.kv_cache_usage is not None else 0.0
        held = 0 if hits is None or inst not in bounded else hits.held(inst)
        return (inst.silent(now, silent_s), usage >= kv_cache_full_fraction, inst not in bounded, -held,
                decode_running(inst, now, metrics_stale_s), usage, inst.last_picked)

    return min(candidates, key=key)
