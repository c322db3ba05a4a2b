import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from neuron_disagg.protocol import (
    BadSignature, Cancel, CancelAck, Heartbeat, MalformedMessage, MessageError, OversizeMessage,
    RankRegions, Region, Registration, TransferId, UnknownVersion, WireCodec, WriteDone, WriteFailed,
)
from neuron_disagg.protocol.wire import WIRE_VERSION

SECRET = b"0123456789abcdef0123456789abcdef"
TID = TransferId("router-req-1", 2)
REGION = Region("layers.0.k", 4096, 1024, 64, 2, 0, 128, 4, 512, 128)
REG = Registration(TID, "d-engine", "d-req-7", "10.0.0.2:5600", 1,
                   (RankRegions(0, "d-agent-0", (REGION,)),), (3, 4, 5), 1, 1234.5)
MESSAGES = [REG, Heartbeat(TID, 12.0), Cancel(TID, "10.0.0.2:5600", 1, "client went away"),
            WriteDone(TID, 0, 1), WriteFailed(TID, 0, 1, "peer disconnected"), CancelAck(TID, 0, 1)]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    codec = WireCodec(SECRET)
    assert codec.decode(codec.encode(message)) == message


def test_forged_signature_is_rejected():
    frame = WireCodec(b"another-secret-of-enough-length!").encode(REG)
    with pytest.raises(BadSignature, match="does not hold this deployment's secret"):
        WireCodec(SECRET).decode(frame)


def test_tampered_body_is_rejected():
    version, mac, body = msgspec.msgpack.decode(WireCodec(SECRET).encode(REG))
    body = body.replace(b"d-req-7", b"d-req-8")
    with pytest.raises(BadSignature):
        WireCodec(SECRET).decode(msgspec.msgpack.encode((version, mac, body)))


def test_unknown_version_is_rejected_with_advice():
    version, mac, body = msgspec.msgpack.decode(WireCodec(SECRET).encode(REG))
    with pytest.raises(UnknownVersion, match="same neuron-disagg release"):
        WireCodec(SECRET).decode(msgspec.msgpack.encode((WIRE_VERSION + 1, mac, body)))


def test_oversize_is_rejected_on_both_ends():
    codec = WireCodec(SECRET, max_message_bytes=200)
    with pytest.raises(OversizeMessage, match="200-byte limit"):
        codec.encode(REG)
    big = WireCodec(SECRET).encode(REG)
    with pytest.raises(OversizeMessage):
        codec.decode(big)


def test_signed_but_ill_typed_body_is_malformed():
    codec = WireCodec(SECRET)
    body = msgspec.msgpack.encode({"type": "heartbeat", "transfer_id": ["r", "not-an-int"], "sent_at": 1.0})
    frame = msgspec.msgpack.encode((WIRE_VERSION, codec._mac(WIRE_VERSION, body), body))
    with pytest.raises(MalformedMessage, match="invalid body"):
        codec.decode(frame)


def test_unknown_message_type_is_malformed():
    codec = WireCodec(SECRET)
    body = msgspec.msgpack.encode({"type": "pickle", "payload": b"cos\nsystem\n"})
    frame = msgspec.msgpack.encode((WIRE_VERSION, codec._mac(WIRE_VERSION, body), body))
    with pytest.raises(MalformedMessage):
        codec.decode(frame)


def test_short_secret_is_refused():
    with pytest.raises(ValueError, match="openssl rand"):
        WireCodec(b"short")


def test_secret_never_in_repr():
    assert "0123456789" not in repr(WireCodec(SECRET))


@settings(max_examples=300)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_only_ever_raise_message_errors(frame):
    with pytest.raises(MessageError):
        WireCodec(SECRET).decode(frame)
