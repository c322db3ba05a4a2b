"""Starts and stops one router: the aiohttp server, its upstream client session and its health
monitor. ``cli.py`` calls ``start_router`` and waits for a signal; tests call it with port 0 and
read ``RunningRouter.url``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from ..kv_params import ParamsSigner
from ..protocol.wire import WireCodec
from .affinity import Affinity
from .app import STATE, build_app
from .kv_events import EventListener
from .prompt_ids import PromptIds
from .flows import Flows
from .health import HealthMonitor, RoleMismatch
from .upstream import Upstream
from .withdraw import Withdrawals
from .instances import Instance
from .metrics import RouterMetrics
from .pool import InstancePool
from .settings import RouterSettings


@dataclass
class RunningRouter:
    url: str                 # e.g. "http://127.0.0.1:43121"
    app: web.Application
    pool: InstancePool
    metrics: RouterMetrics
    _runner: web.AppRunner

    @property
    def session(self) -> aiohttp.ClientSession:
        """The router's upstream session (tests read its connector to count open sockets)."""
        session = self.app[STATE].session
        assert session is not None
        return session

    async def close(self) -> None:
        await self._runner.cleanup()


async def _upstream(app: web.Application) -> AsyncIterator[None]:
    """Lives as long as the app: one pooled client session for every leg, and the health loop."""
    state = app[STATE]
    s = state.settings
    affinity = Affinity(s.block_size, events_stale_s=s.kv_events_stale_s, history_ttl_s=s.prefix_history_ttl_s)
    listener = None
    if s.kv_events_endpoint is not None:  # first: a taken port fails the start before anything else opens
        listener = EventListener(s.kv_events_endpoint, affinity, lambda: {i.url for i in state.pool.all()})
        listener.start()
    state.metrics.watch(affinity, lambda: [i.url for i in state.pool.all()])
    state.pool.on_remove = _also(state.pool.on_remove, lambda inst: affinity.forget(inst.url))
    # No total timeout on the sessions: each leg sets its own (a stream may last many minutes).
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout_s)
    # Idle connections are let go before the instance's own keep-alive timeout ends them: a request
    # sent on one the instance is closing at that moment is dropped unanswered.
    pooled = aiohttp.TCPConnector(limit=s.upstream_connection_limit, limit_per_host=0,
                                  keepalive_timeout=s.upstream_keepalive_s)
    session = aiohttp.ClientSession(connector=pooled, timeout=timeout)
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
        limit=s.upstream_connection_limit, limit_per_host=0, force_close=True), timeout=timeout)
    upstream = Upstream(session, fresh)
    state.session = session
    withdrawals = Withdrawals(state.codec) if state.codec is not None else None
    state.flows = Flows(state.pool, upstream, s, state.metrics, state.signer, withdrawals, affinity,
                        app[PROMPT_IDS])
    state.health = HealthMonitor(state.pool, session, s)
    await state.health.check_all()  # eject what is down before the first request
    wrong = [inst.role_mismatch for inst in state.pool.all() if inst.role_mismatch]
    if wrong:  # every leg sent there would be computed as a plain request: refuse to start
        await session.close()
        await fresh.close()
        if listener is not None:
            await listener.close()
        raise RoleMismatch("; ".join(wrong))
    health_task = asyncio.create_task(state.health.run(), name="router-health")
    try:
        yield
    finally:
        health_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await health_task
        await state.flows.close()
        if listener is not None:
            await listener.close()
        await upstream.close()
        if withdrawals is not None:
            await withdrawals.close()
        state.session = state.flows = state.health = None


def _also(first: Callable[[Instance], None], then: Callable[[Instance], None]) -> Callable[[Instance], None]:
    def both(inst: Instance) -> None:
        first(inst)
        then(inst)
    return both


PROMPT_IDS = web.AppKey("neuron_disagg_prompt_ids", PromptIds)


async def start_router(settings: RouterSettings, instances: Iterable[Instance] = (), *,
                       host: str = "127.0.0.1", port: int = 0, side_channel_port: int = 5600,
                       registry: CollectorRegistry | None = None,
                       shutdown_timeout_s: float = 10.0, signer: ParamsSigner | None = None,
                       codec: WireCodec | None = None) -> RunningRouter:
    """Serves on ``host:port`` (0: any free port) until ``close()``; open streams get up to
    ``shutdown_timeout_s`` to finish on close. ``signer`` signs the kv_transfer_params of modes push
    and pull (without one only vllm-push and vllm-pull work); ``codec`` (the same secret) signs the
    Withdraw sent to a P whose KV no D took (``withdraw.py``; without one P's lease frees it)."""
    metrics = RouterMetrics(registry)
    pool = InstancePool(on_change=metrics.instance_changed, on_remove=metrics.instance_removed)
    for inst in instances:
        pool.add(inst)
    app = build_app(settings, pool, metrics, side_channel_port, signer, codec)
    app[PROMPT_IDS] = PromptIds(settings.tokenizer)  # loaded before anything listens: ValueError names why not
    app.cleanup_ctx.append(_upstream)
    # handler_cancellation: a client that disconnects cancels its handler, which closes both legs.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout_s)
    try:
        await runner.setup()  # runs the first health and role checks (RoleMismatch)
    except BaseException:
        await runner.cleanup()
        raise
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return RunningRouter(f"http://{shown}:{bound_port}", app, pool, metrics, runner)
