"""The router's HTTP surface: routes, the request-id/error middleware, auth, body limits, and the
passthrough, health, metrics and admin endpoints.

``server.start_router`` builds the app with ``build_app`` and owns its lifetime; the completions
handlers validate the body and hand it to ``flows.Flows.handle``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..kv_params import ROLES, ParamsSigner
from .errors import BadRequest, Conflict, PayloadTooLarge, RouterError, Unauthorized, UpstreamRejected, error_body
from .flows import Flows, RequestContext, RequestLog, logger
from .health import HealthMonitor
from .ids import request_id_from_header, transfer_base
from .instances import InstanceSpecError, make_instance
from .upstream import transport_error
from .metrics import RouterMetrics
from .pool import InstancePool
from .requests import parse_client_request
from .settings import RouterSettings
from ..protocol.wire import WireCodec


@dataclass
class RouterState:
    """Everything the handlers share; ``session``, ``flows`` and ``health`` exist while the app runs."""

    settings: RouterSettings
    pool: InstancePool
    metrics: RouterMetrics
    side_channel_port: int
    signer: ParamsSigner | None = None  # signs our modes' kv_transfer_params
    codec: WireCodec | None = None      # signs Withdraw messages to P (withdraw.py)
    session: aiohttp.ClientSession | None = None
    flows: Flows | None = None
    health: HealthMonitor | None = None


STATE = web.AppKey("neuron_disagg_router_state", RouterState)
# Per-request storage keys: typed keys where this aiohttp has them (newer releases warn about
# plain strings), plain strings otherwise.
_RequestKey: Any = getattr(web, "RequestKey", None)
REQUEST_ID: Any = _RequestKey("request_id", str) if _RequestKey else "neuron_disagg.request_id"
FROM_CLIENT: Any = _RequestKey("request_id_from_client", bool) if _RequestKey else "neuron_disagg.from_client"
_STATUS_TYPES = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
                 413: ("invalid_request_error", "body_too_large")}


# -- middleware: request id, typed errors as OpenAI-style JSON --------------------------------------
def _json(status: int, payload: Any) -> web.Response:
    return web.json_response(payload, status=status)


@web.middleware
async def _request_context(request: web.Request, handler: Any) -> web.StreamResponse:
    request_id, from_client = request_id_from_header(request.headers.get("X-Request-Id"))
    request[REQUEST_ID], request[FROM_CLIENT] = request_id, from_client
    try:
        return await handler(request)
    except RouterError as exc:
        return _json(exc.status, exc.body())
    except UpstreamRejected as exc:
        return web.Response(status=exc.status, body=exc.body, headers={"Content-Type": exc.content_type})
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        type_, code = _STATUS_TYPES.get(exc.status, ("invalid_request_error", f"http_{exc.status}"))
        return _json(exc.status, error_body(f"{request.method} {request.path}: {exc.reason}", type_, code))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("[%s] unexpected error in %s %s", request_id, request.method, request.path)
        return _json(500, error_body("internal router error; see the router's log for this request "
                                     "id", "internal_error", "internal_error"))


async def _stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    # Runs for every response just before its headers go out, streaming ones included.
    request_id = request.get(REQUEST_ID) or request_id_from_header(None)[0]
    response.headers["X-Request-Id"] = request_id


# -- helpers ----------------------------------------------------------------------------------------
def _authorize(request: web.Request) -> None:
    key = request.app[STATE].settings.api_key
    if key is None:
        return
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        why = "missing" if not given else "wrong"
        raise Unauthorized(f"{why} API key: send the header 'Authorization: Bearer <router API key>'",
                           code="invalid_api_key")


def _forward_headers(request: web.Request) -> dict[str, str]:
    auth = request.headers.get("Authorization")
    return {"Authorization": auth} if auth else {}


async def _read_body(request: web.Request) -> bytes:
    limit = request.app[STATE].settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes exceeds the router's "
                              f"limit of {limit} bytes (max_body_bytes)", code="body_too_large")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds the router's limit of {limit} bytes "
                              "(max_body_bytes)", code="body_too_large") from None


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await _read_body(request)
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


# -- OpenAI endpoints -------------------------------------------------------------------------------
async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    _authorize(request)
    try:
        req = parse_client_request(request.path, await _read_body(request), state.settings.mode)
    except RouterError:
        state.metrics.requests.labels("none", "invalid").inc()
        raise
    request_id, from_client = request[REQUEST_ID], request[FROM_CLIENT]
    ctx = RequestContext(request_id, transfer_base(request_id, from_client), _forward_headers(request),
                         time.monotonic(), RequestLog(logger, {"request_id": request_id}))
    assert state.flows is not None, "the app is not running"
    return await state.flows.handle(request, req, ctx)


async def _passthrough(request: web.Request) -> web.Response:
    """/v1/models, /tokenize, /detokenize: answered by the least loaded healthy D."""
    state = request.app[STATE]
    _authorize(request)
    inst = state.pool.pick("decode", time.monotonic(), metrics_stale_s=state.settings.metrics_stale_s,
                           kv_cache_full_fraction=state.settings.kv_cache_full_fraction)
    headers = _forward_headers(request)
    data = None
    if request.method == "POST":
        data = await _read_body(request)
        headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
    timeout = aiohttp.ClientTimeout(total=state.settings.decode_first_byte_timeout_s,
                                    sock_connect=state.settings.connect_timeout_s)
    assert state.session is not None, "the app is not running"
    try:
        async with state.session.request(request.method, inst.url + request.path, data=data,
                                         headers=headers, timeout=timeout) as resp:
            body = await resp.read()
            content_type = resp.headers.get("Content-Type", "application/json")
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise transport_error("decode", inst, exc, request.path) from exc
    return web.Response(status=status, body=body, headers={"Content-Type": content_type})


# -- router endpoints -------------------------------------------------------------------------------
async def _health(request: web.Request) -> web.Response:
    """200 while requests can be served: "ok", or "degraded" with no P where D's compute requests whole
    (``decode_fallback``); 503 otherwise."""
    state = request.app[STATE]
    counts = {role: len(state.pool.healthy(role)) for role in ROLES}
    status = ("unavailable" if not counts["decode"] else "ok" if counts["prefill"]
              else "degraded" if state.settings.decode_fallback else "unavailable")
    return _json(503 if status == "unavailable" else 200, {"status": status, "healthy_prefill": counts["prefill"],
                                                           "healthy_decode": counts["decode"]})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _list_instances(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _authorize(request)
    return _json(200, {"mode": state.settings.mode,
                       "instances": [i.describe() for i in state.pool.all()]})


async def _add_instance(request: web.Request) -> web.Response:
    """POST {"role", "url", "side_channel"?, "tp"?}: checked once at once, then every interval."""
    state = request.app[STATE]
    _authorize(request)
    body = await _json_body(request)
    unknown = set(body) - {"role", "url", "side_channel", "tp", "engine_id"}
    if unknown or not isinstance(body.get("url"), str):
        raise BadRequest("expected {\"role\": \"prefill\"|\"decode\", \"url\": \"http://...\", "
                         "\"side_channel\": \"host:port\" (optional), \"tp\": n (optional), "
                         "\"engine_id\": \"id\" (optional)}"
                         + (f"; unknown fields {sorted(unknown)}" if unknown else ""),
                         code="invalid_instance")
    try:
        inst = make_instance(str(body.get("role")), body["url"], body.get("side_channel"),
                             body.get("tp"), state.side_channel_port, body.get("engine_id"))
    except InstanceSpecError as exc:
        raise BadRequest(str(exc), code="invalid_instance") from None
    state.pool.add(inst)
    logger.warning("[%s] admin added %s %s", request[REQUEST_ID], inst.role, inst.url)
    if state.health is not None:
        await state.health.check(inst)
    if inst.role_mismatch:  # it would serve every leg as a plain request
        state.pool.remove(inst.url)
        raise Conflict(f"not added: {inst.role_mismatch}", code="role_mismatch")
    return _json(201, inst.describe())


async def _remove_instance(request: web.Request) -> web.Response:
    """DELETE {"url"} (or ?url=): no new legs go there; open legs finish."""
    state = request.app[STATE]
    _authorize(request)
    url = request.query.get("url") or (await _json_body(request)).get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest("expected {\"url\": \"http://...\"} naming the instance to remove",
                         code="invalid_instance")
    inst = state.pool.remove(url)
    logger.warning("[%s] admin removed %s %s (%d legs still open on it)", request[REQUEST_ID],
                   inst.role, inst.url, inst.in_flight)
    return _json(200, inst.describe())


def build_app(settings: RouterSettings, pool: InstancePool, metrics: RouterMetrics,
              side_channel_port: int, signer: ParamsSigner | None = None,
              codec: WireCodec | None = None) -> web.Application:
    # client_max_size is a backstop; _read_body answers 413 with a clearer message first.
    app = web.Application(middlewares=[_request_context], client_max_size=settings.max_body_bytes)
    app[STATE] = RouterState(settings, pool, metrics, side_channel_port, signer, codec)
    app.on_response_prepare.append(_stamp_request_id)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_get("/v1/models", _passthrough)
    app.router.add_post("/tokenize", _passthrough)
    app.router.add_post("/detokenize", _passthrough)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/instances", _list_instances)
    app.router.add_post("/admin/instances", _add_instance)
    app.router.add_delete("/admin/instances", _remove_instance)
    return app

