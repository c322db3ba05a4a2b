"""What `neuron-disagg bench` starts for each mode, on 127.0.0.1.

- monolithic: one plain vLLM server on core 0.
- ours (push and pull): P on core 0 and D on core 1 with our connector, one router per mode.
- push-whole: push with streaming off (``stream: off``): P writes the whole prompt's KV once the
  prefill is done, as push did before it streamed. A P and D of its own, since the setting is P's.
- push-layers: push streaming by layers too (``stream: layers``), where push streams by steps (the
  default). A P and D of its own, as push-whole.
- vllm-push / vllm-pull: P on core 0 and D on core 1 with vLLM's own NixlPushConnector /
  NixlConnector, behind our router in its vllm-push / vllm-pull mode: same router, same load, so
  the comparison is between connectors.
- push-bind-MS: push behind a router that binds D late (``--bind-horizon-ms MS``: D chosen MS before
  P's predicted answer; 0: at P's answer), on the same P and D's as push and pull.
- ray-push / ray-pull: our connector under Ray Serve LLM instead of our router (`neuron-disagg
  ray-serve`: a local Ray cluster, P replicas on core 0 and D's on core 1, Ray's OpenAI app in
  front), where Ray is installed (Ray 2.60 pins vLLM 0.29: run the bench from that environment so
  every mode serves on one vLLM).

- push-cache / pull-cache: push and pull behind a router that routes by what each instance holds
  (``router/affinity.py``: the instances publish their KV events to it; it tokenizes with the
  model's tokenizer), on the same P's and D's as push and pull, whose routers go by load alone.
- mono2 / mono2-cache: two monolithic instances (one per core) behind our router, by load alone or
  by what each holds: no P, so each instance computes its requests whole (the router's
  ``decode_fallback``), the reference for routing without disaggregation.

``ServerSettings.decodes`` > 1 starts that many D's per topology (all on core 1), behind each
router: the shifting-load preset's 1P2D; ``prefills`` > 1 as many P's (all on core 0).

One topology runs at a time (2 cores): the others are not started yet, or paused (``bench.rounds``).
``ServerSettings`` carries the vLLM flags shared by all of them, so every mode serves with identical
settings.
"""

from __future__ import annotations

import json
import re
import secrets
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Iterator

from ..config import Config
from ..local_cluster import (ServerProcess, disaggregated, free_port, monolithic, ray_serve, reference,
                             reference_engine_id, router, stop_together, vllm_args)
from ..vllm.serve import kv_events_config
from . import keep_affinity
from .spinners import idle_cpu_percent, renice_idle_spinners

MODES = ("monolithic", "push", "push-whole", "pull", "vllm-push", "vllm-pull", "ray-push", "ray-pull",
         "push-cache", "pull-cache", "mono2", "mono2-cache", "push-layers")
DEFAULT_MODES = MODES[:6]  # the ray modes need Ray installed: asked for by name
#: the modes that are push with P's ``stream`` set otherwise, each on a P and D of its own
STREAM_MODES = {"push-whole": "off", "push-layers": "layers"}
#: push-bind-MS: push with the binding horizon MS (``router/binding.py``); not in MODES, any MS goes.
BOUND_LATE = re.compile(r"push-bind-(\d+)")
OURS = ("push", "push-whole", "push-layers", "pull", "push-cache", "pull-cache")  # our connector's modes, which export its metrics
CACHE_AWARE = "-cache"  # a mode's suffix: its router routes by what instances hold


def is_mode(mode: str) -> bool:
    return mode in MODES or BOUND_LATE.fullmatch(mode) is not None


def is_ours(mode: str) -> bool:
    return mode in OURS or BOUND_LATE.fullmatch(mode) is not None


def router_mode(mode: str) -> str:
    """The router's --mode for a bench mode (push-whole, push-bind-MS and push-cache are push
    routers; the mono2 modes' router has no P, and sends each request whole to an instance)."""
    if BOUND_LATE.fullmatch(mode) or mode in STREAM_MODES or mode.startswith("mono2"):
        return "push"
    return mode.removesuffix(CACHE_AWARE)


def router_args(mode: str, server: ServerSettings | None = None, events: str | None = None) -> tuple[str, ...]:
    """A mode's own router flags: its binding horizon; for a cache-aware mode, where it hears the
    instances' KV events (``events``) and the tokenizer and block size it matches prompts with; for
    the others, routing by load alone."""
    late = BOUND_LATE.fullmatch(mode)
    if late:
        return ("--bind-horizon-ms", late.group(1), "--no-prefix-routing")
    if mode.endswith(CACHE_AWARE):
        assert server is not None and events is not None
        return ("--kv-events-endpoint", events, "--tokenizer", server.model, "--block-size", str(server.block_size))
    return ("--no-prefix-routing",)
REFERENCE = "vllm-pull"  # vLLM's NixlConnector: what the published 1,744 ms is measured with


@dataclass(frozen=True)
class ServerSettings:
    model: str
    max_model_len: int = 2048
    kv_cache_bytes: int = 256 << 20
    block_size: int = 32
    extra: tuple[str, ...] = ()  # more `vllm serve` flags, e.g. ("--tensor-parallel-size", "8")
    dtype: str = "auto"
    decodes: int = 1  # D's per disaggregated topology
    prefills: int = 1  # P's per disaggregated topology (ours)
    router_extra: tuple[str, ...] = ()  # more `neuron-disagg router` flags, for every router alike

    def kwargs(self) -> dict:
        return {"max_model_len": self.max_model_len, "kv_cache_bytes": self.kv_cache_bytes,
                "block_size": self.block_size, "extra": self.extra, "dtype": self.dtype}


@dataclass
class Running:
    """A started topology: the URL to load for each mode it serves, and where to look afterwards."""

    urls: dict[str, str]
    instances: list[ServerProcess]
    prefill: ServerProcess | None = None  # the first of ``prefills``
    decodes: list[ServerProcess] = field(default_factory=list)
    timeline_dir: str | None = None  # behind a router: its marks in every mode, the instances' in ours
    routers: dict[str, ServerProcess] = field(default_factory=dict)  # mode -> its router, where it has one
    reniced: dict[str, int] = field(default_factory=dict)  # instance -> spinning threads reniced
    idle_cpu: dict[str, float] = field(default_factory=dict)  # instance -> % of a core with nothing to do
    prefills: list[ServerProcess] = field(default_factory=list)  # every P, ``prefill`` first


def groups(modes: list[str]) -> list[tuple[str, ...]]:
    """The topologies needed for ``modes``, in run order; ours serves push and pull together."""
    out: list[tuple[str, ...]] = []
    if "monolithic" in modes:
        out.append(("monolithic",))
    ours = [m for m in modes if m in ("push", "pull", "push-cache", "pull-cache") or BOUND_LATE.fullmatch(m)]
    # One cache-aware mode per topology: its instances publish their KV events to one endpoint,
    # which one router binds. A second one gets P's and D's of its own, beside its load-only mode.
    apart: list[tuple[str, ...]] = []
    for cached in [m for m in ours if m.endswith(CACHE_AWARE)][1:]:
        base = cached.removesuffix(CACHE_AWARE)
        alone = [m for m in ours if m not in (cached, base)]
        apart.append((base, cached) if base in ours and alone else (cached,))
        ours = [m for m in ours if m not in apart[-1]]
    out += [group for group in (tuple(ours), *apart) if group]
    mono2 = tuple(m for m in ("mono2", "mono2-cache") if m in modes)
    if mono2:
        out.append(mono2)
    out += [(m,) for m in STREAM_MODES if m in modes]
    out += [(m,) for m in ("vllm-push", "vllm-pull") if m in modes]
    ray = tuple(m for m in ("ray-push", "ray-pull") if m in modes)  # one Ray cluster serves both
    if ray:
        out.append(ray)
    return out


@contextmanager
def started(group: tuple[str, ...], server: ServerSettings, ready_timeout_s: float = 600,
            idle_window_s: float = 0) -> Iterator[Running]:
    """Starts the topology for ``group``, yields it healthy, and stops everything it started; with
    ``idle_window_s``, first measures what each instance uses of its core while idle that long."""
    running = _build(group, server)
    launched: list[ServerProcess] = []
    try:
        backends = [i for i in running.instances if i.name != "router"]
        for instance in backends:
            instance.pin_every_process = True  # P's core is P's alone (see ServerProcess)
            launched.append(instance.start())
        for instance in backends:
            instance.wait_ready(ready_timeout_s)
        for instance in backends:  # idle now: what burns a core here would take its model's core
            running.reniced[instance.name] = len(renice_idle_spinners(instance.process.pid))
        if idle_window_s:
            running.idle_cpu = idle_cpu_percent({i.name: i.process.pid for i in backends}, idle_window_s)
        for instance in running.instances:
            if instance.name == "router":
                launched.append(instance.start())
                instance.wait_ready(60)
        yield running
    finally:
        stop_together(launched)


def _build(group: tuple[str, ...], server: ServerSettings) -> Running:
    kw = server.kwargs()
    if group == ("monolithic",):
        mono = monolithic(server.model, free_port(), "0", **kw)
        return Running({"monolithic": mono.url}, [mono])
    if group[0].startswith("ray-"):  # Ray's app in front: its own routing, nothing of ours to mark
        if set(server.extra) - {"--no-enable-prefix-caching"}:
            raise RuntimeError(f"the ray modes pass no other vLLM flags to Ray's engines yet (got {server.extra})")
        ray = ray_serve(server.model, secrets.token_hex(32), modes=tuple(m.removeprefix("ray-") for m in group),
                        max_model_len=server.max_model_len, kv_cache_bytes=server.kv_cache_bytes,
                        block_size=server.block_size, dtype=server.dtype,
                        prefix_caching="--no-enable-prefix-caching" not in server.extra)
        return Running({m: ray.app_url(m.removeprefix("ray-")) for m in group}, [ray])
    marks = tempfile.mkdtemp(prefix="neuron-disagg-bench-timeline-")
    # Where a cache-aware mode's router hears the instances' KV events (they publish there all along).
    events = f"127.0.0.1:{free_port()}" if any(m.endswith(CACHE_AWARE) for m in group) else None
    if group[0].startswith("mono2"):
        return _two_monolithic(group, server, marks, events)
    p_side = free_port()
    if group[0].startswith("vllm-"):  # the router marks its part; vLLM's instances mark nothing
        mode = group[0]
        keeps_pinning = keep_affinity.server_env()  # else vLLM's NIXL workers both move to core 1
        p = reference(mode, "prefill", server.model, free_port(), p_side, "0", keeps_pinning, **kw)
        ds = _named([reference(mode, "decode", server.model, free_port(), free_port(), "1", keeps_pinning, **kw)
                     for _ in range(server.decodes)])
        r = router([(p.url, p_side)], [d.url for d in ds], free_port(), mode, [reference_engine_id("prefill", p.port)],
                   timeline_dir=marks, extra_args=server.router_extra)
        return Running({mode: r.url}, [p, *ds, r], p, ds, marks, routers={mode: r})
    secret = secrets.token_hex(32)
    overrides = {"timeline_dir": marks, **({"stream": STREAM_MODES[group[0]]} if group[0] in STREAM_MODES else {}),
                 **({"kv_events_endpoint": events} if events else {})}
    sides = [p_side, *(free_port() for _ in range(server.prefills - 1))]
    ps = _named([disaggregated("prefill", server.model, free_port(), side, "0", secret, overrides, **kw) for side in sides])
    ds = _named([disaggregated("decode", server.model, free_port(), free_port(), "1", secret, overrides, **kw)
                 for _ in range(server.decodes)])
    routers = {m: router([(p.url, side) for p, side in zip(ps, sides, strict=True)], [d.url for d in ds], free_port(), router_mode(m),
                         timeline_dir=marks, secret=secret, extra_args=(*router_args(m, server, events), *server.router_extra))
               for m in group}
    return Running({m: r.url for m, r in routers.items()}, [*ps, *ds, *routers.values()], ps[0], ds, marks,
                   routers=routers, prefills=ps)


def _two_monolithic(group: tuple[str, ...], server: ServerSettings, marks: str, events: str | None) -> Running:
    """The mono2 modes: a plain vLLM on each core, publishing its KV events where ``events`` says,
    behind a router with no P (it sends each request whole to one of them, which it reads as D's)."""
    monos = []
    for i in range(2):
        port = free_port()
        published = () if events is None else (
            "--kv-events-config", json.dumps(kv_events_config(Config(kv_events_endpoint=events), vllm_args(port))))
        mono = monolithic(server.model, port, str(i), **{**server.kwargs(), "extra": (*server.extra, *published)})
        mono.name = f"monolithic{i}"
        monos.append(mono)
    routers = {m: router([], [mono.url for mono in monos], free_port(), router_mode(m), timeline_dir=marks,
                         secret=secrets.token_hex(32), extra_args=(*router_args(m, server, events), *server.router_extra))
               for m in group}
    return Running({m: r.url for m, r in routers.items()}, [*monos, *routers.values()], None, monos, marks,
                   routers=routers)


def _named(decodes: list[ServerProcess]) -> list[ServerProcess]:
    """Several P's or D's: each named by its place (its log file and the bench's notes tell them apart)."""
    if len(decodes) > 1:
        for i, d in enumerate(decodes):
            d.name = f"{d.name}{i}"
    return decodes
