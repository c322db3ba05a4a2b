"""Encode, sign, verify and decode wire messages. The only place bytes become messages.

Frame: a msgpack array ``[version, mac, body]`` where ``body`` is the msgpack-encoded message and
``mac = HMAC-SHA256(secret, version || body)``. Decoding checks, in this order and before any
message object exists: size, frame shape, version, signature, then the body's exact schema.
No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from .errors import BadSignature, MalformedMessage, OversizeMessage, UnknownVersion
from .messages import Message

WIRE_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MIN_SECRET_BYTES = 16

_encoder = msgspec.msgpack.Encoder()
_frame_decoder = msgspec.msgpack.Decoder(tuple[int, bytes, bytes])
_body_decoder = msgspec.msgpack.Decoder(Message)


class WireCodec:
    """Signs outgoing and verifies incoming messages under one deployment secret."""

    def __init__(self, secret: bytes, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the deployment secret must be at least {MIN_SECRET_BYTES} bytes; "
                "generate one with `openssl rand -hex 32`"
            )
        self._secret = secret
        self.max_message_bytes = max_message_bytes

    def __repr__(self) -> str:  # never show the secret
        return f"WireCodec(max_message_bytes={self.max_message_bytes})"

    def _mac(self, version: int, body: bytes) -> bytes:
        return hmac.new(self._secret, version.to_bytes(2, "big") + body, hashlib.sha256).digest()

    def encode(self, message: Message) -> bytes:
        body = _encoder.encode(message)
        frame = _encoder.encode((WIRE_VERSION, self._mac(WIRE_VERSION, body), body))
        if len(frame) > self.max_message_bytes:
            raise OversizeMessage(
                f"{type(message).__name__} encodes to {len(frame)} bytes, over the "
                f"{self.max_message_bytes}-byte limit (max_message_bytes)"
            )
        return frame

    def decode(self, frame: bytes) -> Message:
        if len(frame) > self.max_message_bytes:
            raise OversizeMessage(
                f"message of {len(frame)} bytes exceeds the {self.max_message_bytes}-byte limit"
            )
        try:
            version, mac, body = _frame_decoder.decode(frame)
        except (msgspec.DecodeError, ValueError) as exc:
            raise MalformedMessage(f"not a neuron-disagg frame: {exc}") from None
        if version != WIRE_VERSION:
            raise UnknownVersion(
                f"wire version {version} is not supported (this build speaks {WIRE_VERSION}); "
                "run the same neuron-disagg release on prefill and decode"
            )
        if not hmac.compare_digest(mac, self._mac(version, body)):
            raise BadSignature(
                "signature check failed: the sender does not hold this deployment's secret"
            )
        try:
            return _body_decoder.decode(body)
        except (msgspec.DecodeError, ValueError) as exc:
            raise MalformedMessage(f"signed message has an invalid body: {exc}") from None
