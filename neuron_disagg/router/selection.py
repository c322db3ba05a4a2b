"""Which instance gets the next leg: by load, never round robin.

Called by ``InstancePool.pick`` with the healthy candidates. Pure functions of the instances'
counters, so tests can check the choice without servers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .instances import Instance


def pick_prefill(candidates: list[Instance]) -> Instance:
    """P's cost is prefill compute, which grows with prompt tokens: pick the P with the fewest
    prompt tokens this router has outstanding on it, then the fewest legs, then the one picked
    longest ago (so equal instances take turns)."""
    return min(candidates, key=lambda i: (i.prompt_tokens, i.in_flight, i.last_picked))


def decode_running(inst: Instance, now: float, metrics_stale_s: float) -> float:
    """Sequences D is running: the router's own open legs (fresh, but blind to other routers) or
    D's own count from its last /metrics scrape (complete, but up to one interval old), the larger."""
    running = float(inst.in_flight)
    engine = inst.engine
    if engine is not None and now - engine.at <= metrics_stale_s:
        running = max(running, engine.running + engine.waiting)
    return running


def pick_decode(candidates: list[Instance], now: float, metrics_stale_s: float,
                kv_cache_full_fraction: float, silent_s: float = 1.0) -> Instance:
    """D's cost is decode batch size and KV memory. Picked last: a D gone silent (``Instance.silent``:
    stopped or hung, not yet ejected), then one whose KV cache is nearly full (its new requests would
    wait for blocks); then the fewest running sequences, the lowest KV usage, the one picked longest ago."""

    def key(inst: Instance) -> tuple[bool, bool, float, float, int]:
        engine = inst.engine
        fresh = engine is not None and now - engine.at <= metrics_stale_s
        usage = engine.kv_cache_usage if fresh and engine.kv_cache_usage is not None else 0.0
        return (inst.silent(now, silent_s), usage >= kv_cache_full_fraction,
                decode_running(inst, now, metrics_stale_s), usage, inst.last_picked)

    return min(candidates, key=key)
