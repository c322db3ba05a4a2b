"""The ``kv_transfer_params`` contract: the router writes them with the builders below, the
connector's scheduler side reads them with ``parse``; nothing else writes or reads them.

Push, prefill leg:  {"neuron_disagg": 1, "role": "prefill", "mode": "push", "transfer_id": "req#0"}
Push, decode leg:   {"neuron_disagg": 1, "role": "decode", "mode": "push", "transfer_id": "req#0",
                     "p_side_channel": "host:port", "p_tp_size": 8}
Pull, prefill leg:  as push with "mode": "pull"; its response carries {"neuron_disagg": 1, "offer": ...}
Pull, decode leg:   {"neuron_disagg": 1, "role": "decode", "mode": "pull", "transfer_id": ..., "offer": ...}
                    or, for a list of prompts, "offers": [...], one per distinct prompt (each names
                    its prompt's transfer; the connector takes the one for its own)

Every set the router writes is signed (``ParamsSigner``): it also carries "prompts" (how many
distinct prompts the HTTP request has), "expires_ms" and "signature", an HMAC-SHA256 under the
deployment secret of all its other fields. A set is good for the prompts of one HTTP request: the
connector remembers each set it acted on until it expires (``vllm/scheduler_side.py``, ``SingleUse``), and a
request that brings it again with another prompt, or with the same one later, runs as a plain
request and is counted (``neuron_disagg_params_replayed_total``). vLLM's HTTP port
takes ``kv_transfer_params`` from whoever reaches it, so the connector acts only on verified ones;
anything else — unsigned, altered, signed with another secret, expired — runs as a plain request,
computed where it arrived, and is counted (``neuron_disagg_params_rejected_total``). A forged
``p_side_channel`` is therefore never contacted, and a client gains nothing it could not get by
sending the request without them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .protocol.messages import TransferId
from .protocol.timeouts import DEFAULTS
from .protocol.wire import MIN_SECRET_BYTES

KEY = "neuron_disagg"  # present, with the contract's version, in every set of params that is ours
VERSION = 1
#: Which side a leg, an instance or a rank is: P or D.
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = get_args(Role)


_DOMAIN = b"neuron-disagg kv_transfer_params v1\0"  # a params signature is never a wire message's


class BadTransferParams(ValueError):
    pass


class ParamsSigner:
    """Signs (router) and verifies (connector) ``kv_transfer_params`` under the deployment secret.

    ``ttl_s`` bounds how long signed params may be replayed; it should exceed the longest a request
    waits in P's or D's queue (one that waits longer runs as a plain request). ``skew_s``: how far
    the router's clock may run ahead of the instance's."""

    def __init__(self, secret: bytes, ttl_s: float = DEFAULTS.params_ttl_s,
                 skew_s: float = DEFAULTS.clock_skew_allowance_s):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the deployment secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret, self.ttl_s, self.skew_s = secret, ttl_s, skew_s

    def __repr__(self) -> str:  # never show the secret
        return f"ParamsSigner(ttl_s={self.ttl_s})"

    def _mac(self, fields: dict[str, Any]) -> str:
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hmac.new(self._secret, _DOMAIN + canonical.encode(), hashlib.sha256).hexdigest()

    def sign(self, params: dict[str, Any], now: float | None = None) -> dict[str, Any]:
        fields = {**params, "expires_ms": int(((time.time() if now is None else now) + self.ttl_s) * 1000)}
        return {**fields, "signature": self._mac(fields)}

    def verify(self, params: dict[str, Any], now: float | None = None) -> dict[str, Any]:
        """The params without their signature fields; raises BadTransferParams saying why not."""
        fields = {k: v for k, v in params.items() if k != "signature"}
        signature, expires_ms = params.get("signature"), fields.get("expires_ms")
        if not isinstance(signature, str) or not isinstance(expires_ms, int):
            raise BadTransferParams("kv_transfer_params are not signed (only the router may set them)")
        if not hmac.compare_digest(signature.encode("utf-8", "replace"), self._mac(fields).encode()):
            raise BadTransferParams("kv_transfer_params signature does not match: altered, or not signed "
                                    "with this deployment's secret")
        now = time.time() if now is None else now
        if now - self.skew_s > expires_ms / 1000:
            raise BadTransferParams(f"kv_transfer_params expired {now - expires_ms / 1000:.1f} s ago "
                                    f"(signed for {self.ttl_s:g} s)")
        del fields["expires_ms"]
        return fields


# -- the router writes ------------------------------------------------------------------------------
def prefill(signer: ParamsSigner, mode: Literal["push", "pull"], transfer_id: str, prompts: int = 1) -> dict[str, Any]:
    return signer.sign({KEY: VERSION, "role": "prefill", "mode": mode, "transfer_id": transfer_id,
                        "prompts": prompts})


def push_decode(signer: ParamsSigner, transfer_id: str, p_side_channel: str, p_tp_size: int,
                prompts: int = 1) -> dict[str, Any]:
    return signer.sign({KEY: VERSION, "role": "decode", "mode": "push", "transfer_id": transfer_id,
                        "p_side_channel": p_side_channel, "p_tp_size": p_tp_size, "prompts": prompts})


def pull_decode(signer: ParamsSigner, transfer_id: str, answers: list[dict[str, Any]]) -> dict[str, Any]:
    """``answers``: what each of P's legs answered (``prefill_answer``; one per distinct prompt)."""
    offers = [answer["offer"] for answer in answers]
    return signer.sign({KEY: VERSION, "role": "decode", "mode": "pull", "transfer_id": transfer_id,
                        "offers": offers, "prompts": len(offers)})


# -- the connector writes, on P in pull mode, into its response ---------------------------------------
def prefill_answer(offer_frame_b64: str) -> dict[str, Any]:
    return {KEY: VERSION, "offer": offer_frame_b64}


# -- the connector reads ----------------------------------------------------------------------------

MAX_PROMPTS = 4096


@dataclass(frozen=True)
class LegParams:
    role: Role
    mode: Literal["push", "pull"]
    transfer_id: TransferId
    p_side_channel: str = ""
    p_tp_size: int = 1
    offers: tuple[str, ...] = ()  # base64 signed PullOffers (pull, decode leg)
    prompts: int = 1              # distinct prompts of the HTTP request these params were signed for
    signature: str = ""           # names this signed set (SingleUse)
    expires_at: float = 0.0       # Unix seconds
    answers_decode: bool = False  # P, pull: answer D's whole signed params (no router to write them)


def unsigned_prefill(params: dict[str, Any] | None, request_id: str, ttl_s: float,
                     now: float | None = None) -> LegParams | None:
    """A prefill leg marked only with vLLM's own ``do_remote_decode`` (llm-d's routing sidecar sends
    it, and passes P's answer to D verbatim): a pull leg whose answer is D's whole params. Its
    transfer is named by the engine request id, less vLLM's prefix for one of ``n`` samples
    ("<i>_"), so that samples of one prompt share it. None for anything else."""
    if not params or KEY in params or params.get("do_remote_decode") is not True or params.get("do_remote_prefill"):
        return None
    request = f"ext-{re.sub(r'^[0-9]+_', '', request_id)}"
    return LegParams("prefill", "pull", TransferId(request, 0), signature=f"unsigned:{request}",
                     expires_at=(time.time() if now is None else now) + ttl_s, answers_decode=True)


def format_transfer_id(request: str, attempt: int) -> str:
    """The ``transfer_id`` of params, ``<request>#<attempt>``: what ``parse_transfer_id`` reads back,
    and what a ``TransferId``'s ``router_attempt()`` prints (logs, timelines and failure reasons are
    keyed by it)."""
    return str(TransferId(request, attempt))


def parse_transfer_id(text: str) -> TransferId:
    request, sep, attempt = str(text).rpartition("#")
    if not sep or not request or not attempt.isdigit():
        raise BadTransferParams(f"transfer_id {text!r} is not '<request>#<attempt>'")
    return TransferId(request, int(attempt))


def parse(params: dict[str, Any] | None, signer: ParamsSigner, now: float | None = None) -> LegParams | None:
    """None when the request is not ours (no "neuron_disagg" key): it runs as a plain request.
    Raises BadTransferParams for ours that are unsigned, forged, expired or malformed."""
    if not params or KEY not in params:
        return None
    signed = {"signature": str(params.get("signature")), "expires_at": params.get("expires_ms", 0) / 1000}
    params = signer.verify(params, now)
    role, mode = params.get("role"), params.get("mode", "push")
    if role not in ROLES or mode not in ("push", "pull"):
        raise BadTransferParams(f"kv_transfer_params role={role!r} mode={mode!r} is not supported")
    tid = parse_transfer_id(params.get("transfer_id", ""))
    prompts = params.get("prompts", 1)
    if not isinstance(prompts, int) or isinstance(prompts, bool) or not 1 <= prompts <= MAX_PROMPTS:
        raise BadTransferParams(f"kv_transfer_params prompts={prompts!r} is not a count of 1..{MAX_PROMPTS}")
    signed["prompts"] = prompts
    if role == "decode" and mode == "push":
        side = params.get("p_side_channel", "")
        if ":" not in str(side):
            raise BadTransferParams("a push decode leg needs p_side_channel 'host:port'")
        return LegParams(role, mode, tid, str(side), int(params.get("p_tp_size", 1)), **signed)
    if role == "prefill":
        return LegParams(role, mode, tid, **signed)
    offers = params.get("offers", [params["offer"]] if params.get("offer") else [])
    if not isinstance(offers, list) or not offers or not all(isinstance(o, str) and o for o in offers):
        raise BadTransferParams("a pull decode leg needs the prefill's offer (or offers, one per prompt)")
    return LegParams(role, mode, tid, offers=tuple(offers), **signed)
