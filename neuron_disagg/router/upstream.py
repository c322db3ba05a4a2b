"""One upstream HTTP call each: the P leg (answer drained) and the D leg (relayed to the client).

``flows.py`` creates them; every failure comes out as a typed error naming the instance and a
reason code (``prefill_unreachable``, ``decode_timeout``, ...), and a 4xx answer as
``UpstreamRejected`` so the client sees the instance's own complaint.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp

from .errors import RouterError, UpstreamFailed, UpstreamRejected, UpstreamTimeout
from .instances import Instance
from .pool import InstancePool

log = logging.getLogger("neuron_disagg.router")

if sys.version_info >= (3, 11):
    async def _within(awaitable: Awaitable[bytes], timeout_s: float) -> bytes:
        # asyncio.timeout does not create a task per call as wait_for does (one per chunk adds up).
        async with asyncio.timeout(timeout_s):
            return await awaitable
else:  # pragma: no cover - Python 3.10
    async def _within(awaitable: Awaitable[bytes], timeout_s: float) -> bytes:
        return await asyncio.wait_for(awaitable, timeout_s)


@dataclass(frozen=True)
class Upstream:
    """The router's client sessions. ``pooled`` keeps connections to instances alive between legs;
    ``fresh`` opens a new connection for each request, for sending a leg once more after the
    instance dropped its kept-alive connection unanswered — the pool's other idle connections to
    it are as likely stale (a server resuming from a pause drops all of them at once), and a second
    stale one would fail the leg for good."""

    pooled: aiohttp.ClientSession
    fresh: aiohttp.ClientSession

    async def close(self) -> None:
        await asyncio.gather(self.pooled.close(), self.fresh.close())


def _snippet(raw: bytes, limit: int = 300) -> str:
    text = raw[:limit].decode("utf-8", "replace").strip()
    return text + ("..." if len(raw) > limit else "")


def _message(raw: bytes) -> str | None:
    """The message of an OpenAI-style error body (vLLM: {"error": {"message"}}, older {"message"})."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    message = (error if isinstance(error, dict) else body if isinstance(body, dict) else {}).get("message")
    return message if isinstance(message, str) else None


def _status_error(leg: str, inst: Instance, url: str, status: int, raw: bytes,
                  content_type: str) -> Exception:
    if status < 500:
        return UpstreamRejected(status, raw, content_type, url)
    message = _message(raw)
    if message and message.startswith("KV transfer failed:"):  # our connector's reason (vllm/failures.py)
        return UpstreamFailed(f"{message}; decode instance {inst.url}", code="kv_transfer_failed", instance=inst)
    return UpstreamFailed(f"{leg} instance {inst.url} answered {status}: {message or _snippet(raw)}",
                          code=f"{leg}_error", status=503 if status == 503 else 502, instance=inst)


def transport_error(leg: str, inst: Instance, exc: BaseException, what: str) -> RouterError:
    """Maps what aiohttp raised to a typed error. Timeouts first: aiohttp's are ClientErrors too."""
    if isinstance(exc, asyncio.TimeoutError):
        return UpstreamTimeout(f"{leg} instance {inst.url} timed out ({what})",
                               code=f"{leg}_timeout", instance=inst)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamFailed(f"{leg} instance {inst.url} is unreachable: {exc.os_error}",
                              code=f"{leg}_unreachable", instance=inst, unreachable=True)
    return UpstreamFailed(f"{leg} instance {inst.url} broke the connection ({what}): "
                          f"{type(exc).__name__}: {exc}", code=f"{leg}_disconnected", instance=inst)


def _reset_unanswered(exc: BaseException) -> bool:
    """The instance dropped the kept-alive connection our request went out on, without a byte of
    answer. After a pause longer than its keep-alive timeout (a long GC, swap, SIGSTOP) a vLLM
    server closes its idle connections first thing, unread requests in them and all: sending once
    more is what a client would do, and even a duplicate is harmless (the connector makes it a
    sibling of the first: P computes the prompt once, D loads it once)."""
    return isinstance(exc, aiohttp.ServerDisconnectedError) or (
        isinstance(exc, aiohttp.ClientOSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE))


async def prefill_leg(upstream: Upstream, inst: Instance, path: str,
                      body: dict[str, Any], headers: dict[str, str],
                      timeout: aiohttp.ClientTimeout) -> dict[str, Any]:
    """Sends P its leg and returns P's JSON answer (push drains it, pull reads its
    ``kv_transfer_params``). Cancelling the caller closes the connection, and vLLM aborts."""
    url = inst.url + path
    for attempt, session in ((1, upstream.pooled), (2, upstream.fresh)):
        try:
            async with session.post(url, json=body, headers=headers, timeout=timeout) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise _status_error("prefill", inst, url, resp.status, raw,
                                        resp.headers.get("Content-Type", "application/json"))
            break
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if attempt == 1 and _reset_unanswered(exc):
                log.warning("prefill instance %s dropped the connection before answering (%s); sending "
                            "the leg again", inst.url, exc)
                continue
            raise transport_error("prefill", inst, exc, "prefill leg") from exc
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise UpstreamFailed(f"prefill instance {inst.url} answered 200 with a body that is not a "
                             f"JSON object: {_snippet(raw)}", code="prefill_bad_answer", instance=inst)
    return answer


class DecodeLeg:
    """D's leg. ``open`` sends it and waits for D's first body byte (streaming) or whole answer;
    until then nothing has reached the client and the flow may still cancel and retry. ``chunks``
    yields the rest of the stream; ``close`` aborts the request (closing the connection makes vLLM
    abort it and D's connector free its blocks) and releases the router's lease on D. The flow
    always calls ``close``."""

    def __init__(self, upstream: Upstream, pool: InstancePool, inst: Instance,
                 path: str, body: dict[str, Any], transfer_id: str, headers: dict[str, str], *,
                 connect_timeout_s: float, first_byte_timeout_s: float, idle_timeout_s: float):
        self.inst = inst
        self.transfer_id = transfer_id
        self._upstream, self._pool = upstream, pool
        self._url, self._body, self._headers = inst.url + path, body, headers
        self._connect_timeout_s = connect_timeout_s
        self._first_byte_timeout_s = first_byte_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._resp: aiohttp.ClientResponse | None = None
        self._lease = ExitStack()
        self.status = 0
        self.content_type = "application/json"
        self.first = b""  # the first chunk, or the whole answer if not streaming

    async def open(self, stream: bool) -> None:
        self._lease.enter_context(self._pool.lease(self.inst))
        try:
            await asyncio.wait_for(self._open(stream), self._first_byte_timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise transport_error("decode", self.inst, exc, "waiting for the first byte") from exc

    async def _open(self, stream: bool) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
        try:
            self._resp = resp = await self._upstream.pooled.post(self._url, json=self._body,
                                                                 headers=self._headers, timeout=timeout)
        except aiohttp.ClientError as exc:
            if not _reset_unanswered(exc):
                raise
            log.warning("decode instance %s dropped the connection before answering (%s); sending "
                        "the leg again", self.inst.url, exc)
            self._resp = resp = await self._upstream.fresh.post(self._url, json=self._body,
                                                                headers=self._headers, timeout=timeout)
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", self.content_type)
        if resp.status >= 400:
            raise _status_error("decode", self.inst, self._url, resp.status, await resp.read(),
                                self.content_type)
        self.first = await (resp.content.readany() if stream else resp.read())
        if stream:  # from here D is expected to keep sending (``Instance.silent``), until ``close``
            self._lease.enter_context(self.inst.streaming(time.monotonic()))

    async def chunks(self) -> AsyncIterator[bytes]:
        assert self._resp is not None, "open() first"
        while True:
            try:
                chunk = await _within(self._resp.content.readany(), self._idle_timeout_s)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                err = transport_error("decode", self.inst, exc, "mid-stream")
                err.code = "decode_stream_broken"
                raise err from exc
            if not chunk:
                return
            self.inst.last_chunk_at = time.monotonic()
            yield chunk

    def close(self) -> None:
        if self._resp is not None:
            self._resp.close()
        self._lease.close()
