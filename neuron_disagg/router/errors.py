"""Typed errors the router answers with, each rendered as an OpenAI-style error body.

Handlers and flows raise these; the error middleware in ``app.py`` turns them into
``{"error": {"message", "type", "code"}}`` with the right HTTP status. ``code`` is a stable reason
string that also labels ``neuron_disagg_router_failures_total``.
"""

from __future__ import annotations

import json
from typing import Any


class RouterError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, code: str = "internal_error", status: int | None = None, *,
                 instance: Any = None, unreachable: bool = False):
        super().__init__(message)
        self.message = message
        self.code = code
        if status is not None:
            self.status = status
        self.instance = instance        # the upstream Instance at fault, if any
        self.unreachable = unreachable  # connection refused or reset: eject it until a check passes

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code)


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"


class NotFound(RouterError):
    status = 404
    type = "not_found_error"


class Conflict(RouterError):
    status = 409
    type = "invalid_request_error"


class PayloadTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"


class NoInstance(RouterError):
    """No healthy instance of a role is available (503): add one or wait for one to recover."""

    status = 503
    type = "service_unavailable"


class UpstreamFailed(RouterError):
    """An instance could not be reached, broke the connection or answered 5xx (502 / 503)."""

    status = 502
    type = "upstream_error"


class UpstreamTimeout(RouterError):
    status = 504
    type = "timeout_error"


class UpstreamRejected(Exception):
    """An instance answered 4xx: the client's request is at fault, so its answer is relayed as is."""

    def __init__(self, status: int, body: bytes, content_type: str, url: str):
        super().__init__(f"{url} answered {status}")
        self.status, self.body, self.content_type, self.url = status, body, content_type, url


def error_body(message: str, type_: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


def sse_error_event(error: RouterError) -> bytes:
    """What a stream that already started gets instead of a status code (vLLM does the same)."""
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"
