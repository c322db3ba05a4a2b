"""Typed errors of the protocol core. Each message says what went wrong and what to do."""


class ProtocolError(Exception):
    """An event arrived in a state for which the transition table defines nothing.

    Raised only by cores built with ``strict=True`` (tests); production cores count it instead.
    """


class MessageError(ValueError):
    """A wire message was rejected before it reached any state machine."""

    reason = "malformed"  # the counter label this rejection is filed under


class OversizeMessage(MessageError):
    reason = "oversize"


class UnknownVersion(MessageError):
    reason = "unknown_version"


class BadSignature(MessageError):
    reason = "bad_signature"


class MalformedMessage(MessageError):
    reason = "malformed"


class PlanError(ValueError):
    """Two sides' KV geometries or block lists cannot be matched; no write may be issued."""
