"""The ``kv_transfer_params`` contract: the router writes them with the builders below, the
connector's scheduler side reads them with ``parse``; nothing else writes or reads them.

Push, prefill leg:  {"neuron_disagg": 1, "role": "prefill", "mode": "push", "transfer_id": "req#0"}
Push, decode leg:   {"neuron_disagg": 1, "role": "decode", "mode": "push", "transfer_id": "req#0",
                     "p_side_channel": "host:port", "p_tp_size": 8}
Pull, prefill leg:  as push with "mode": "pull"; its response carries {"neuron_disagg": 1, "offer": ...}
Pull, decode leg:   {"neuron_disagg": 1, "role": "decode", "mode": "pull", "transfer_id": ..., "offer": ...}
                    or, for a list of prompts, "offers": [...], one per distinct prompt (each names
                    its prompt's transfer; the connector takes the one for its own)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .protocol.messages import TransferId

KEY = "neuron_disagg"  # present, with the contract's version, in every set of params that is ours
VERSION = 1


class BadTransferParams(ValueError):
    pass


# -- the router writes ------------------------------------------------------------------------------
def prefill(mode: Literal["push", "pull"], transfer_id: str) -> dict[str, Any]:
    return {KEY: VERSION, "role": "prefill", "mode": mode, "transfer_id": transfer_id}


def push_decode(transfer_id: str, p_side_channel: str, p_tp_size: int) -> dict[str, Any]:
    return {KEY: VERSION, "role": "decode", "mode": "push", "transfer_id": transfer_id,
            "p_side_channel": p_side_channel, "p_tp_size": p_tp_size}


def pull_decode(transfer_id: str, answers: list[dict[str, Any]]) -> dict[str, Any]:
    """``answers``: what each of P's legs answered (``prefill_answer``; one per distinct prompt)."""
    offers = [answer["offer"] for answer in answers]
    return {KEY: VERSION, "role": "decode", "mode": "pull", "transfer_id": transfer_id, "offers": offers}


# -- the connector writes, on P in pull mode, into its response ---------------------------------------
def prefill_answer(offer_frame_b64: str) -> dict[str, Any]:
    return {KEY: VERSION, "offer": offer_frame_b64}


# -- the connector reads ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LegParams:
    role: Literal["prefill", "decode"]
    mode: Literal["push", "pull"]
    transfer_id: TransferId
    p_side_channel: str = ""
    p_tp_size: int = 1
    offers: tuple[str, ...] = ()  # base64 signed PullOffers (pull, decode leg)


def parse_transfer_id(text: str) -> TransferId:
    request, sep, attempt = str(text).rpartition("#")
    if not sep or not request or not attempt.isdigit():
        raise BadTransferParams(f"transfer_id {text!r} is not '<request>#<attempt>'")
    return TransferId(request, int(attempt))


def parse(params: dict[str, Any] | None) -> LegParams | None:
    """None when the request is not ours (no "neuron_disagg" key): it runs as a plain request."""
    if not params or KEY not in params:
        return None
    role, mode = params.get("role"), params.get("mode", "push")
    if role not in ("prefill", "decode") or mode not in ("push", "pull"):
        raise BadTransferParams(f"kv_transfer_params role={role!r} mode={mode!r} is not supported")
    tid = parse_transfer_id(params.get("transfer_id", ""))
    if role == "decode" and mode == "push":
        side = params.get("p_side_channel", "")
        if ":" not in str(side):
            raise BadTransferParams("a push decode leg needs p_side_channel 'host:port'")
        return LegParams(role, mode, tid, str(side), int(params.get("p_tp_size", 1)))
    if role == "prefill":
        return LegParams(role, mode, tid)
    offers = params.get("offers", [params["offer"]] if params.get("offer") else [])
    if not isinstance(offers, list) or not offers or not all(isinstance(o, str) and o for o in offers):
        raise BadTransferParams("a pull decode leg needs the prefill's offer (or offers, one per prompt)")
    return LegParams(role, mode, tid, offers=tuple(offers))
