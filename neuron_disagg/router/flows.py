"""One client request through P and D: push (both legs at once) or pull (P, then D), a retry on
another P, and the relay of D's answer to the client.

``app.py`` builds one ``Flows`` per router and calls ``handle`` from the completions handlers
after validating the body. Invariants kept here:
- nothing reaches the client before D's first byte, so until then a failed P can be retried;
- every leg that is abandoned is closed (vLLM aborts the request; D's connector frees its
  blocks), and a retry is a new transfer id ``attempt + 1`` with a new D leg, which supersedes
  the old attempt on both sides (I1);
- a client that goes away cancels every leg (the handler is cancelled: ``handler_cancellation``);
- a request no P can take (none healthy, or P's leg failed with no retry left) is sent whole to a D,
  which computes its prompt itself (``decode_fallback``), rather than failing: the client waits a
  prefill on D instead of getting a 502.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .affinity import Affinity
from .binding import bind_at
from .prompt_ids import PromptIds
from .selection import Hits, decode_running
from .errors import (NoInstance, RouterError, UpstreamFailed, UpstreamRejected, UpstreamTimeout,
                     sse_error_event)
from .instances import Instance
from .upstream import DecodeLeg, Upstream, prefill_leg
from .withdraw import Withdrawals
from .metrics import RouterMetrics
from .pool import InstancePool
from .requests import (ClientRequest, decode_body, prefill_bodies, prefill_body, prompt_count, pull_decode_params,
                       push_decode_params, require_signer)
from ..kv_params import ParamsSigner, Role, format_transfer_id
from ..timeline import Timeline
from .settings import PUSH_MODES, Mode, RouterSettings

logger = logging.getLogger("neuron_disagg.router")


class RequestLog(logging.LoggerAdapter):
    """Prefixes every line with the request id, whatever the handler's format."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['request_id']}] {msg}", kwargs  # type: ignore[index]


@dataclass
class RequestContext:
    request_id: str          # the X-Request-Id the client sees
    transfer_base: str       # the request half of every transfer id
    headers: dict[str, str]  # forwarded to instances (the client's Authorization)
    arrived: float           # monotonic
    log: RequestLog
    arrived_at: float = field(default_factory=time.time)  # wall clock, for the timeline
    prefix_keys: list[bytes] = field(default_factory=list)  # the prompt's block chain (``affinity.py``)
    hits: Hits | None = None  # what each instance holds of the prompt; None: routed by load alone


@dataclass(frozen=True)
class PrefillLeg:
    """A P leg as dispatched: when it was sent, when P should answer it (None: no pace yet), and
    the prompt tokens it carries."""

    sent: float
    predicted: float | None
    tokens: int


def _has_offer(params: dict[str, Any]) -> bool:
    return isinstance(params.get("offer"), str)


async def _cancel(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Flows:
    def __init__(self, pool: InstancePool, upstream: Upstream, settings: RouterSettings,
                 metrics: RouterMetrics, signer: ParamsSigner | None,
                 withdrawals: Withdrawals | None = None, affinity: Affinity | None = None,
                 prompt_ids: PromptIds | None = None):
        self.pool, self.upstream, self.settings, self.metrics = pool, upstream, settings, metrics
        self.affinity = affinity  # what instances hold; None: routed by load alone
        self.prompt_ids = prompt_ids or PromptIds()
        self.signer = signer  # signs our modes' kv_transfer_params; None: vLLM's connectors only
        self.withdrawals = withdrawals  # tells P what no D took (our modes); None: P's lease does
        self.timeline = Timeline(settings.timeline_dir, "router")
        self._p_timeout = aiohttp.ClientTimeout(total=settings.prefill_timeout_s,
                                                sock_connect=settings.connect_timeout_s)
        self._draining: set[asyncio.Task] = set()  # push: P legs answered after D was (``_drain``)

    # -- entry point ------------------------------------------------------------------------------
    async def handle(self, request: web.Request, req: ClientRequest,
                     ctx: RequestContext) -> web.StreamResponse:
        outcome = "ok"
        p_task: asyncio.Task | None = None
        d_leg: DecodeLeg | None = None
        try:
            if not req.mode.startswith("vllm-"):
                require_signer(self.signer)  # before any leg starts
            await self._match(req, ctx)
            if req.mode in PUSH_MODES:
                d_leg, p_task = await self._push(req, ctx)
            else:
                d_leg = await self._pull(req, ctx)
            resp, outcome = await self._relay(request, req, ctx, d_leg)
            if p_task is not None:  # push: P's answer is drained after the client has D's
                self._drain(p_task)
                p_task = None
            return resp
        except RouterError as exc:
            outcome = {502: "upstream_error", 503: "unavailable", 504: "timeout"}.get(exc.status, "error")
            if isinstance(exc, NoInstance):
                self.metrics.failures.labels(exc.code).inc()
            ctx.log.warning("failed: %s (%s)", exc.message, exc.code)
            raise
        except UpstreamRejected as exc:
            outcome = "rejected"
            ctx.log.info("%s; relaying its answer to the client", exc)
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            self.metrics.failures.labels("client_disconnected").inc()
            ctx.log.info("client went away; cancelling every leg")
            raise
        finally:
            if p_task is not None:
                await _cancel(p_task)  # a no-op if done; also collects its exception
            if d_leg is not None:
                d_leg.close()
            elapsed = time.monotonic() - ctx.arrived
            self.metrics.requests.labels(req.mode, outcome).inc()
            self.metrics.e2e.labels(req.mode).observe(elapsed)
            ctx.log.debug("%s request ended: %s after %.3f s", req.mode, outcome, elapsed)

    def _drain(self, p_task: asyncio.Task) -> None:
        """Push: D's answer is the client's; P's one-token answer is read in the background, bounded
        by prefill_timeout_s, rather than before the client gets D's. Before, a non-streaming answer
        waited for it: with P stopped, D answered within seconds (it gave the load up on its probes
        and computed the prompt) and the client still waited for P to resume or time out."""
        self._draining.add(p_task)
        p_task.add_done_callback(self._drained)

    def _drained(self, p_task: asyncio.Task) -> None:
        self._draining.discard(p_task)
        if not p_task.cancelled():
            p_task.exception()  # a P that failed after D answered was logged; retrieved, not re-raised

    async def close(self) -> None:
        """At shutdown: P legs still draining are closed."""
        await _cancel(*self._draining)

    # -- push: P's leg at arrival, D's at the binding horizon, under one transfer id --------------
    async def _push(self, req: ClientRequest, ctx: RequestContext) -> tuple[DecodeLeg, asyncio.Task | None]:
        tried: set[Instance] = set()
        attempt = 0
        horizon_ms = self.settings.bind_horizon_ms if req.mode == "push" else None
        while True:
            p = self._pick_prefill(tried, ctx)
            if p is None:
                return await self._whole_on_decode(req, ctx, attempt, "no_prefill"), None
            tid = format_transfer_id(ctx.transfer_base, attempt)
            self.timeline.mark(tid, "router_arrived", ctx.arrived_at)
            leg = self._dispatch(p, req.prompt_tokens)
            p_task = asyncio.create_task(self._prefill(req, ctx, p, tid, req.mode, leg))
            d_leg: DecodeLeg | None = None
            d_task: asyncio.Task | None = None
            committed = False
            try:
                horizon_s = None if horizon_ms is None else horizon_ms / 1e3
                await self._until_bind_time(p_task, bind_at(leg.predicted, horizon_s, leg.sent), req.mode)
                if not (p_task.done() and p_task.exception() is not None):  # else P failed unbound: retry
                    try:
                        d = self._pick("decode", ctx)  # from D's load now, not at arrival
                    except NoInstance as exc:
                        self._withdraw_if_untaken(req, p, None, tid, exc)
                        raise
                    ctx.log.debug("push transfer_id=%s P=%s D=%s", tid, p.url, d.url)
                    d_leg = self._decode_leg(req, ctx, d, tid, push_decode_params(
                        req.mode, tid, p.side_channel, p.tp, self.signer, p.engine_id, req.path,
                        prompt_count(req.body)))
                    d_task = asyncio.create_task(self._open_decode(d_leg, req, ctx, tid))
                    done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                    if d_task in done or p_task.exception() is None:
                        try:
                            await d_task  # D's failure is the request's failure; P is cancelled below
                        except (RouterError, UpstreamRejected) as exc:
                            self._withdraw_if_untaken(req, p, d, tid, exc)
                            raise
                        committed = True
                        return d_leg, p_task
                # P failed before D sent anything (or before D was bound). D would wait for KV that
                # never comes: close its leg (finally) and, if allowed, start over on another P with
                # a new transfer id.
                exc = p_task.exception()
                assert exc is not None
                tried.add(p)
                if not self._may_retry(exc, attempt, tried):
                    if not self._may_compute_on_decode(exc):
                        raise exc
                    fallback = exc
                    break
                ctx.log.warning("transfer_id=%s: P %s failed (%s); %s, retrying on another P", tid, p.url,
                                getattr(exc, "code", exc), "no D bound yet" if d_leg is None else f"cancelled D {d_leg.inst.url}")
                self.metrics.retries.labels(req.mode, getattr(exc, "code", "error")).inc()
            finally:
                if not committed:
                    await _cancel(p_task, *([d_task] if d_task is not None else []))
                    if d_leg is not None:
                        d_leg.close()
            attempt += 1
        return await self._whole_on_decode(req, ctx, attempt + 1, fallback.code), None

    # -- pull: P first, then D with P's kv_transfer_params ----------------------------------------
    async def _pull(self, req: ClientRequest, ctx: RequestContext) -> DecodeLeg:
        tried: set[Instance] = set()
        attempt = 0
        while True:
            p = self._pick_prefill(tried, ctx)
            if p is None:
                return await self._whole_on_decode(req, ctx, attempt, "no_prefill")
            tid = format_transfer_id(ctx.transfer_base, attempt)
            self.timeline.mark(tid, "router_arrived", ctx.arrived_at)
            ctx.log.debug("pull transfer_id=%s P=%s", tid, p.url)
            try:  # one leg, or one per distinct prompt of a list: D needs each prompt's offer
                bodies = prefill_bodies(req, req.mode, tid, self.signer)
                answers = await asyncio.gather(*(self._prefill(req, ctx, p, tid, req.mode, self._dispatch(
                    p, req.prompt_tokens // len(bodies)), body) for body in bodies))
                break
            except (RouterError, UpstreamRejected) as exc:
                tried.add(p)
                if not self._may_retry(exc, attempt, tried):
                    if not self._may_compute_on_decode(exc):
                        raise
                    return await self._whole_on_decode(req, ctx, attempt + 1, exc.code)
                ctx.log.warning("transfer_id=%s: P %s failed (%s); retrying on another P",
                                tid, p.url, getattr(exc, "code", exc))
                self.metrics.retries.labels(req.mode, getattr(exc, "code", "error")).inc()
            attempt += 1
        d: Instance | None = None
        try:  # P holds what it offered until a D reads it, or we say none will
            p_params = [answer.get("kv_transfer_params") for answer in answers]
            wanted = dict if req.mode == "vllm-pull" else _has_offer
            if not all(isinstance(params, dict) and wanted(params) for params in p_params):
                self.metrics.failures.labels("prefill_no_kv_transfer_params").inc()
                raise UpstreamFailed(
                    f"prefill instance {p.url} answered without its kv_transfer_params offer (got "
                    f"{[type(params).__name__ for params in p_params]}); is it running the neuron_disagg connector?",
                    code="prefill_no_kv_transfer_params", instance=p)
            d = self._pick("decode", ctx)  # late decode choice: the point of pull
            d_leg = self._decode_leg(req, ctx, d, tid, pull_decode_params(req.mode, tid, p_params, self.signer))
            try:
                await self._open_decode(d_leg, req, ctx, tid)
            except BaseException:
                d_leg.close()
                raise
        except (RouterError, UpstreamRejected) as exc:
            self._withdraw_if_untaken(req, p, d, tid, exc)
            raise
        return d_leg

    # -- pieces -----------------------------------------------------------------------------------
    async def _match(self, req: ClientRequest, ctx: RequestContext) -> None:
        """What each healthy instance holds of the prompt, into ``ctx`` (once per request; the time
        it takes, tokenizing included, is measured). Text is tokenized off the event loop: about
        1.3 us a token here, which would hold up every other request's relay meanwhile."""
        if self.affinity is None or not self.settings.prefix_routing:
            return
        started = time.perf_counter()
        ids = (await asyncio.to_thread(self.prompt_ids.ids, req) if self.prompt_ids.tokenizes(req)
               else self.prompt_ids.ids(req))
        if ids is None:
            return
        affinity, now = self.affinity, time.monotonic()
        keys = affinity.keys(ids)
        held = {inst: affinity.hit_blocks(inst.url, keys, now) * affinity.block_size
                for inst in self.pool.all() if inst.healthy}
        ctx.prefix_keys = keys
        ctx.hits = Hits(len(ids), lambda inst: held.get(inst, 0), self.settings.affinity_epsilon,
                        self.settings.affinity_window_s)
        self.metrics.affinity_seconds.observe(time.perf_counter() - started)

    def _pick(self, role: Role, ctx: RequestContext, exclude: set[Instance] | None = None) -> Instance:
        now = time.monotonic()
        inst = self.pool.pick(role, now, exclude=frozenset(exclude or ()),
                              metrics_stale_s=self.settings.metrics_stale_s,
                              kv_cache_full_fraction=self.settings.kv_cache_full_fraction,
                              silent_s=self.settings.decode_silent_s, hits=ctx.hits)
        if ctx.hits is not None and self.affinity is not None:
            self.metrics.prefix_tokens.labels(role).inc(ctx.hits.tokens)
            self.metrics.prefix_held_tokens.labels(role).inc(ctx.hits.held(inst))
            self.affinity.routed(inst.url, ctx.prefix_keys, now)
        return inst

    def _note_decode_balance(self, mode: Mode) -> None:
        """How unevenly the healthy D's are loaded as a D leg goes out: the most running sequences over
        the mean (1: even), which binding later is meant to keep low."""
        now = time.monotonic()
        running = [decode_running(i, now, self.settings.metrics_stale_s) for i in self.pool.healthy("decode")]
        mean = sum(running) / len(running) if running else 0.0
        if mean > 0:
            self.metrics.decode_imbalance.labels(mode).observe(max(running) / mean)

    def _pick_prefill(self, tried: set[Instance], ctx: RequestContext) -> Instance | None:
        """A P for the next attempt; None when none is healthy and a D may compute the request whole."""
        try:
            return self._pick("prefill", ctx, tried)
        except NoInstance:
            if not self.settings.decode_fallback or tried:
                raise
            return None

    def _may_compute_on_decode(self, exc: BaseException) -> bool:
        """P is down or broken (not the request: a 4xx is relayed; not slow: a timeout already cost
        the client its wait) and no P is left to retry on."""
        return self.settings.decode_fallback and isinstance(exc, UpstreamFailed)

    async def _whole_on_decode(self, req: ClientRequest, ctx: RequestContext, attempt: int, why: str) -> DecodeLeg:
        """A D computes the request whole, as a plain request (no kv_transfer_params: its connector
        leaves it alone), under a transfer id of its own."""
        d = self._pick("decode", ctx)
        tid = format_transfer_id(ctx.transfer_base, attempt)
        ctx.log.warning("transfer_id=%s: no P can take the request (%s); D %s computes it whole", tid, why, d.url)
        self.metrics.computed_on_decode.labels(req.mode, why).inc()
        leg = self._decode_leg(req, ctx, d, tid, None)
        try:
            await self._open_decode(leg, req, ctx, tid)
        except BaseException:
            leg.close()
            raise
        return leg

    def _may_retry(self, exc: BaseException, attempt: int, tried: set[Instance]) -> bool:
        """Another P can help when this one is down or broken (connect error, reset, 5xx) — not
        when the request is at fault (4xx) and not after a timeout (that would double the wait).
        With no other healthy P the client gets P's own failure, not a "no instance" 503."""
        return (isinstance(exc, UpstreamFailed) and attempt < self.settings.prefill_retries
                and any(i not in tried for i in self.pool.healthy("prefill")))

    def _withdraw_if_untaken(self, req: ClientRequest, p: Instance, d: Instance | None, tid: str,
                             exc: BaseException) -> None:
        """P computed (or is computing) the prompt for a D that never got the request: D refused it
        (4xx), could not be reached, or none was sent (``d`` is None). Tell P (``withdraw.py``)."""
        if self.withdrawals is None or req.mode.startswith("vllm-"):
            return
        if d is not None and not (isinstance(exc, UpstreamRejected) or getattr(exc, "unreachable", False)):
            return  # D may have registered or be reading: its own Cancel, ReadFailed or P's lease end it
        why = (f"decode instance {d.url} refused the request" if isinstance(exc, UpstreamRejected)
               else f"no decode instance got the request ({getattr(exc, 'code', type(exc).__name__)})")
        self.withdrawals.withdraw(p, tid, why)
        self.metrics.withdrawals.inc()

    def _failed(self, ctx: RequestContext, tid: str, exc: RouterError) -> None:
        self.metrics.failures.labels(exc.code).inc()
        ctx.log.warning("transfer_id=%s: %s (%s)", tid, exc.message, exc.code)
        if exc.unreachable and exc.instance is not None and self.pool.set_health(exc.instance, False):
            ctx.log.warning("ejected %s until a health check passes", exc.instance.url)

    def _dispatch(self, p: Instance, tokens: int) -> PrefillLeg:
        """A P leg about to be sent: when, and when P should answer it (``binding.py``)."""
        now = time.monotonic()
        return PrefillLeg(now, p.pace.dispatch(now, tokens), tokens)

    async def _until_bind_time(self, p_task: asyncio.Task, when: float | None, mode: Mode) -> None:
        """Push: returns when D's leg should go out (``binding.bind_at``), or once P's leg ended."""
        started = time.monotonic()
        if when is None:
            await asyncio.wait({p_task})
        elif when > started:
            await asyncio.wait({p_task}, timeout=when - started)
        self.metrics.bind_wait.labels(mode).observe(time.monotonic() - started)

    async def _prefill(self, req: ClientRequest, ctx: RequestContext, p: Instance, tid: str, mode: Mode,
                       leg: PrefillLeg, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """P's leg (``leg``: from ``_dispatch``); its answer measures P's pace."""
        self.metrics.prefill_legs.labels(p.url).inc()
        with self.pool.lease(p, req.prompt_tokens):
            try:
                answer = await prefill_leg(self.upstream, p, req.path, body or prefill_body(req, mode, tid, self.signer),
                                           {**ctx.headers, "X-Request-Id": tid}, self._p_timeout)
            except BaseException as exc:
                p.pace.ended(time.monotonic(), leg.predicted)
                if isinstance(exc, RouterError):
                    self._failed(ctx, tid, exc)
                raise
            now = time.monotonic()
            p.pace.answered(leg.sent, now, leg.tokens, leg.predicted)
            if self.affinity is not None:
                self.affinity.leg_ended(p.url, now)
            if leg.predicted is not None:
                self.metrics.prediction_error.observe(leg.predicted - now)
                self.timeline.mark(tid, "router_p_predicted", time.time() + (leg.predicted - now))
            self.timeline.mark(tid, "router_p_answered")
            return answer

    def _decode_leg(self, req: ClientRequest, ctx: RequestContext, d: Instance, tid: str,
                    params: dict[str, Any] | None) -> DecodeLeg:
        """D's leg, about to go out: the moment D is bound, whatever the mode."""
        self._note_decode_balance(req.mode)
        self.metrics.decode_legs.labels(d.url).inc()
        self.timeline.mark(tid, "router_d_bound")
        s = self.settings
        return DecodeLeg(self.upstream, self.pool, d, req.path, decode_body(req, params), tid,
                         {**ctx.headers, "X-Request-Id": tid},
                         connect_timeout_s=s.connect_timeout_s,
                         first_byte_timeout_s=s.decode_first_byte_timeout_s,
                         idle_timeout_s=s.decode_idle_timeout_s)

    async def _open_decode(self, leg: DecodeLeg, req: ClientRequest, ctx: RequestContext,
                           tid: str) -> None:
        try:
            await leg.open(req.stream)
        except RouterError as exc:
            self._failed(ctx, tid, exc)
            raise
        self.timeline.mark(tid, "router_first_byte")
        if self.affinity is not None:  # D has the prompt's blocks by its first token
            self.affinity.leg_ended(leg.inst.url, time.monotonic())
        ctx.log.debug("transfer_id=%s: first byte from D %s", tid, leg.inst.url)

    async def _relay(self, request: web.Request, req: ClientRequest, ctx: RequestContext,
                     leg: DecodeLeg) -> tuple[web.StreamResponse, str]:
        headers = {"Content-Type": leg.content_type}
        if not req.stream:
            return web.Response(status=leg.status, body=leg.first, headers=headers), "ok"
        headers["Cache-Control"] = "no-cache"
        resp = web.StreamResponse(status=leg.status, headers=headers)
        outcome = "ok"
        try:
            await resp.prepare(request)
            self.metrics.ttft.labels(req.mode).observe(time.monotonic() - ctx.arrived)
            await resp.write(leg.first)
            try:
                async for chunk in leg.chunks():
                    await resp.write(chunk)
            except (UpstreamFailed, UpstreamTimeout) as exc:
                # Too late for a status code: end the stream with an error event, as vLLM does.
                self._failed(ctx, leg.transfer_id, exc)
                outcome = "upstream_error"
                await resp.write(sse_error_event(exc))
            await resp.write_eof()
        except ConnectionResetError:  # the client closed the stream; the caller closes the legs
            self.metrics.failures.labels("client_disconnected").inc()
            ctx.log.info("client closed the stream; cancelling every leg")
            outcome = "cancelled"
        return resp, outcome
