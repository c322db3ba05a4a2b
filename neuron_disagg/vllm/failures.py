"""Why a request's KV did not arrive, told to the client that gets the error.

With ``kv_load_failure_policy: fail`` vLLM ends such a request with its generic "Internal server
error": the reason is known only in the worker that saw the transfer fail. It travels with the
connector's stats — worker, engine core, API server: the path vLLM's own metrics take — and
``remember`` keeps it here, in the API server process, by the router's transfer id. ``serve``
installs ``kv_failure_reasons`` as vLLM HTTP middleware (``--middleware``): a 500 answer, or a
stream's error event, for a request whose ``X-Request-Id`` names a transfer that failed says why,
e.g. "KV transfer failed: lease expired". The router sends that header on every leg.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict

from ..kv_params import format_transfer_id
from ..protocol.messages import TransferId

MIDDLEWARE = f"{__name__}.kv_failure_reasons"
_GENERIC = b"Internal server error"  # vLLM's message for a request that finished with an error
_KEEP = 4096  # reasons remembered; each is read back within a second or never
_WAIT_S = 1.0  # the stats that carry a reason can reach the API server just after the error does
_recent: OrderedDict[str, str] = OrderedDict()  # reasons that came before anyone asked
_waiting: dict[str, asyncio.Future[str]] = {}  # answers waiting for their reason


def router_transfer_id(transfer: TransferId) -> str:
    """The id the router sent (its X-Request-Id) for one prompt's transfer (``transfer_key``)."""
    return format_transfer_id(transfer.request, transfer.attempt)


def remember(failed: dict[str, str]) -> None:
    """API server process, on its event loop (vLLM records stats there): reasons that arrived with
    the connector's stats. An answer already waiting for one is woken; the others are kept."""
    for transfer_id, reason in failed.items():
        waiter = _waiting.pop(transfer_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(reason)
            continue
        _recent[transfer_id] = reason
        _recent.move_to_end(transfer_id)
    while len(_recent) > _KEEP:
        _recent.popitem(last=False)


async def _reason(transfer_id: str | None) -> str | None:
    if not transfer_id:
        return None
    if transfer_id in _recent:
        return _recent.pop(transfer_id)
    waiter = _waiting[transfer_id] = asyncio.get_running_loop().create_future()
    try:
        return await asyncio.wait_for(waiter, _WAIT_S)
    except asyncio.TimeoutError:
        return None  # not a KV failure: vLLM's own error stands
    finally:
        if _waiting.get(transfer_id) is waiter:
            del _waiting[transfer_id]


def _message(reason: str) -> str:
    return f"KV transfer failed: {reason} (kv_load_failure_policy: fail)"


def _told(reason: str) -> bytes:
    return json.dumps(_message(reason))[1:-1].encode()  # as it sits inside a JSON string


def _error_event(reason: str) -> bytes:
    error = {"message": _message(reason), "type": "InternalServerError", "param": None, "code": 500}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


async def kv_failure_reasons(request, call_next):
    """vLLM HTTP middleware (Starlette's ``@app.middleware("http")`` form)."""
    response = await call_next(request)
    streaming = response.headers.get("content-type", "").startswith("text/event-stream")
    if response.status_code != 500 and not streaming:
        return response
    transfer_id = request.headers.get("x-request-id")
    if streaming:
        chunks = response.body_iterator

        async def told():
            said = answered = False
            async for chunk in chunks:
                if not isinstance(chunk, bytes):
                    pass
                elif _GENERIC in chunk and b'"error"' in chunk:
                    reason = await _reason(transfer_id)
                    chunk, said = (chunk.replace(_GENERIC, _told(reason)), True) if reason else (chunk, said)
                elif chunk.startswith(b"data: [DONE]") and not (said or answered):
                    # vLLM 0.29 ends the stream of a request that failed before its first token with
                    # no event at all: nothing but [DONE]. Say why before it.
                    reason = await _reason(transfer_id)
                    if reason:
                        yield _error_event(reason)
                elif chunk.startswith(b"data: {"):
                    answered = True
                yield chunk
        response.body_iterator = told()
        return response
    from starlette.responses import Response  # vLLM's server is Starlette's

    body = b"".join([chunk async for chunk in response.body_iterator])
    reason = await _reason(transfer_id) if _GENERIC in body else None
    if reason:
        body = body.replace(_GENERIC, _told(reason))
    headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
    return Response(body, status_code=response.status_code, headers=headers)
