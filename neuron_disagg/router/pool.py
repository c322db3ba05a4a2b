"""The router's pool of P and D instances: added and removed at runtime, picked by load
(``selection.py``), and leased for the length of each leg, which is what the load-based choice
counts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Callable

from ..kv_params import Role
from .errors import Conflict, NoInstance, NotFound
from .instances import Instance, InstanceSpecError, normalise_url
from .selection import Hits, pick_decode, pick_prefill


@dataclass
class InstancePool:
    """Every instance by URL. Single event loop: no locks; mutations never await."""

    on_change: Callable[[Instance], None] = lambda inst: None   # metrics hook
    on_remove: Callable[[Instance], None] = lambda inst: None
    _by_url: dict[str, Instance] = field(default_factory=dict)
    _picks: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def add(self, inst: Instance) -> Instance:
        if inst.url in self._by_url:
            raise Conflict(f"{inst.url} is already a {self._by_url[inst.url].role} instance; "
                           "remove it first to change it", code="instance_exists")
        self._by_url[inst.url] = inst
        self.on_change(inst)
        return inst

    def remove(self, url: str) -> Instance:
        """Stops new legs going to ``url``; legs already open on it run to their end."""
        try:
            key = str(normalise_url(url))
        except InstanceSpecError:
            key = url
        inst = self._by_url.pop(key, None)
        if inst is None:
            raise NotFound(f"no instance {url!r}; known: {sorted(self._by_url)}", code="unknown_instance")
        inst.removed = True
        self.on_remove(inst)
        return inst

    def all(self) -> list[Instance]:
        return list(self._by_url.values())

    def healthy(self, role: Role) -> list[Instance]:
        return [i for i in self._by_url.values() if i.role == role and i.healthy]

    def pick(self, role: Role, now: float, *, exclude: frozenset[Instance] = frozenset(),
             metrics_stale_s: float = 30.0, kv_cache_full_fraction: float = 0.95,
             silent_s: float = 1.0, hits: Hits | None = None) -> Instance:
        """The healthy instance of ``role`` not in ``exclude`` that ``selection.py`` prefers: the least
        loaded, or within a load bound the one holding most of the prompt (``hits``); NoInstance if none."""
        candidates = [i for i in self.healthy(role) if i not in exclude]
        if not candidates:
            known = sum(1 for i in self._by_url.values() if i.role == role)
            why = "all tried" if exclude and known else ("none healthy" if known else "none configured")
            raise NoInstance(f"no {role} instance available ({why}; {known} known)",
                             code=f"no_{role}_instance")
        if role == "prefill":
            chosen = pick_prefill(candidates, hits, now)
        else:
            chosen = pick_decode(candidates, now, metrics_stale_s, kv_cache_full_fraction, silent_s, hits)
        chosen.last_picked = next(self._picks)
        chosen.picked_at.append(now)
        return chosen

    def set_health(self, inst: Instance, healthy: bool) -> bool:
        """Returns True if this changed the instance's state."""
        changed = inst.healthy != healthy
        inst.healthy = healthy
        if changed and not inst.removed:
            self.on_change(inst)
        return changed

    @contextmanager
    def lease(self, inst: Instance, prompt_tokens: int = 0) -> Iterator[Instance]:
        """Counts one open leg (and its prompt tokens) against ``inst`` while the block runs."""
        inst.in_flight += 1
        inst.prompt_tokens += prompt_tokens
        if not inst.removed:  # a removed instance keeps its open legs but loses its series
            self.on_change(inst)
        try:
            yield inst
        finally:
            inst.in_flight -= 1
            inst.prompt_tokens -= prompt_tokens
            if not inst.removed:
                self.on_change(inst)
