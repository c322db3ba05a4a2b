"""The P and D instances behind the router, and the router's live view of each one's load.

``cli.py`` parses ``--prefill``/``--decode`` specs with ``parse_instance_spec``; the admin
endpoints add and remove instances at runtime (``pool.py``); ``health.py`` flips ``healthy`` and
fills ``engine``; ``flows.py`` picks instances through ``InstancePool.pick`` and holds a ``lease``
on each one for the length of a leg, which is what the load-based choice counts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from yarl import URL

from ..kv_params import ROLES, Role
from .binding import PrefillPace

SPEC_FORM = ("URL[,side_channel=HOST:PORT][,tp=N][,engine_id=ID], e.g. "
             "http://10.0.0.5:8100,side_channel=10.0.0.5:5600,tp=8")


class InstanceSpecError(ValueError):
    """An instance spec or admin request is malformed; the message shows the accepted form."""


@dataclass
class EngineLoad:
    """What a D's own /metrics said at ``at`` (monotonic seconds)."""

    running: float
    waiting: float
    kv_cache_usage: float | None
    at: float


@dataclass(eq=False)
class Instance:
    role: Role
    url: str
    side_channel: str
    tp: int = 1
    engine_id: str | None = None  # a P running vLLM's NixlPushConnector: its kv engine_id
    healthy: bool = True
    failed_checks: int = 0
    in_flight: int = 0          # legs this router has open on the instance
    prompt_tokens: int = 0      # P only: estimated prompt tokens of those legs
    last_picked: int = 0        # pick sequence number: ties go to the one picked longest ago
    engine: EngineLoad | None = None
    removed: bool = False
    role_mismatch: str | None = None  # its connector runs the other role (health.py): why
    pace: PrefillPace = field(default_factory=PrefillPace)  # P only: when its legs should be answered
    # What the router has asked and not yet heard back (``silent``): the oldest health probe still
    # unanswered (a timeout does not clear it; an answer does), and, while D legs stream, the last chunk.
    unanswered_since: float | None = None
    streams: int = 0
    last_chunk_at: float = 0.0
    picked_at: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))  # when each leg was sent here

    def picked_within(self, now: float, window_s: float) -> int:
        """Legs sent here in the last ``window_s``: its share of the traffic, open legs or not."""
        while self.picked_at and self.picked_at[0] < now - window_s:
            self.picked_at.popleft()
        return len(self.picked_at)

    def silent(self, now: float, after_s: float) -> bool:
        """Asked and not answering for ``after_s``: a health probe unanswered that long, or streams
        that long without a chunk. A stopped process (SIGSTOP, a hung host) is silent long before
        its health checks fail enough to eject it."""
        waiting = [t for t in (self.unanswered_since, self.last_chunk_at if self.streams else None) if t is not None]
        return bool(waiting) and now - min(waiting) > after_s

    @contextmanager
    def streaming(self, now: float) -> Iterator[None]:
        """One of its D legs relays a stream while the block runs; it just sent a chunk (at ``now``)."""
        self.streams += 1
        self.last_chunk_at = max(self.last_chunk_at, now)
        try:
            yield
        finally:
            self.streams -= 1

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "url": self.url, "healthy": self.healthy,
                               "in_flight": self.in_flight}
        if self.role == "prefill":
            out.update(side_channel=self.side_channel, tp=self.tp, prompt_tokens=self.prompt_tokens)
            if self.engine_id:
                out["engine_id"] = self.engine_id
        if self.engine is not None:
            out["engine"] = {"running": self.engine.running, "waiting": self.engine.waiting,
                             "kv_cache_usage": self.engine.kv_cache_usage}
        if self.role_mismatch:
            out["role_mismatch"] = self.role_mismatch
        return out


def normalise_url(url: str) -> URL:
    """An instance URL as the pool keys it: without a trailing slash, query or fragment."""
    try:
        parsed = URL(url.strip())
    except (ValueError, TypeError) as exc:
        raise InstanceSpecError(f"{url!r} is not a URL ({exc}); expected {SPEC_FORM}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise InstanceSpecError(f"{url!r} must be an http:// or https:// URL with a host; "
                                f"expected {SPEC_FORM}")
    return parsed.with_path(parsed.path.rstrip("/")).with_query(None).with_fragment(None)


def _check_side_channel(value: str) -> str:
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InstanceSpecError(f"side_channel {value!r} must be HOST:PORT with a port in 1..65535")
    return value.strip()


def make_instance(role: str, url: str, side_channel: str | None, tp: int | str | None,
                  default_side_channel_port: int, engine_id: str | None = None) -> Instance:
    """Validates one instance description (from a spec or the admin endpoint)."""
    if role not in ROLES:
        raise InstanceSpecError(f"role must be 'prefill' or 'decode', got {role!r}")
    parsed = normalise_url(url)
    if side_channel is None:
        host = f"[{parsed.host}]" if ":" in (parsed.host or "") else parsed.host
        side_channel = f"{host}:{default_side_channel_port}"
    try:
        tp_size = 1 if tp is None else int(tp)
    except (TypeError, ValueError):
        tp_size = 0
    if tp_size < 1 or isinstance(tp, bool):
        raise InstanceSpecError(f"tp must be a positive integer, got {tp!r}")
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id.strip()):
        raise InstanceSpecError(f"engine_id must be a non-empty string, got {engine_id!r}")
    return Instance(role, str(parsed), _check_side_channel(side_channel), tp_size,  # type: ignore[arg-type]
                    engine_id.strip() if engine_id else None)


def parse_instance_spec(role: str, spec: str, default_side_channel_port: int) -> Instance:
    """``http://h:8100[,side_channel=h:5600][,tp=2]``; side_channel defaults to the URL's host and
    the deployment config's ``side_channel_port``."""
    url, *options = [part.strip() for part in spec.split(",")]
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("side_channel", "tp", "engine_id") or key in values:
            raise InstanceSpecError(f"bad option {option!r} in --{role} {spec!r}; expected {SPEC_FORM}")
        values[key] = value
    return make_instance(role, url, values.get("side_channel"), values.get("tp"),
                         default_side_channel_port, values.get("engine_id"))
