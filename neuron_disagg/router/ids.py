"""Request ids (the ``X-Request-Id`` a client sees) and transfer ids (what P and D share).

A transfer id is ``<request>#<attempt>``: ``kv_params.format_transfer_id`` writes it and
``kv_params.parse_transfer_id`` reads it back.
"""

from __future__ import annotations

import re
import secrets
import uuid

# A client's X-Request-Id is echoed and logged, so it must be short and printable; '#' is excluded
# because it separates the attempt in a transfer id.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_from_header(value: str | None) -> tuple[str, bool]:
    """The request id for a response: the client's ``X-Request-Id`` if usable, else a new one.

    Returns ``(request_id, from_client)``.
    """
    if value and _CLIENT_ID.fullmatch(value):
        return value, True
    return new_request_id(), False


def transfer_base(request_id: str, from_client: bool) -> str:
    """The ``request`` half of every transfer id of one client request.

    A client may reuse an ``X-Request-Id`` for concurrent requests; two transfers with the same id
    would fence each other on P and D (invariant I1), so a client's id gets a random suffix.
    """
    return f"{request_id}.{secrets.token_hex(4)}" if from_client else request_id
