"""How a request's two legs are shaped under Ray Serve LLM, on vLLM's OpenAI request models: the
same contract our router writes (``kv_params``), signed on D's replica. Pure: no Ray, no I/O, so
the fast tests check it where Ray is not installed.

push: P's leg and D's leg together; D's names the P replica Ray picked, by what that replica
      published (``peer_metadata``).
pull: one P leg per distinct prompt (P answers a request with its first prompt's offer only); D's
      leg carries every offer P answered, or runs plain (D computes) when one is missing.
"""

from __future__ import annotations

from typing import Any, Literal

from .. import kv_params
from ..kv_params import ParamsSigner
from ..router.requests import PREFILL_DROPS, PREFILL_SETS, distinct_prompts

#: What a P replica publishes in Ray's ``replica_metadata``, under this one key.
PEER_KEY = "neuron_disagg"


def peer_metadata(side_channel: str, tp: int) -> dict[str, Any]:
    return {PEER_KEY: {"side_channel": side_channel, "tp": tp}}


def transfer_id(request) -> str:
    """The request's transfer id: the same for both legs, which Ray shapes in separate calls."""
    request_id = getattr(request, "request_id", None)
    if not request_id:  # vLLM's request models give every request one
        raise ValueError("a request without request_id: its two legs could not be matched")
    return kv_params.format_transfer_id(f"ray-{request_id}", 0)


def _prompts(request) -> list[Any] | None:
    return distinct_prompts({"prompt": getattr(request, "prompt", None)})


def prompt_count(request) -> int:
    return len(_prompts(request) or [request])


def prefill_legs(request, mode: Literal["push", "pull"], signer: ParamsSigner) -> list:
    leg = request.model_copy(deep=True)
    fields = type(leg).model_fields
    # P's leg as our router shapes it (router.requests): on a request model, a dropped field
    # goes back to its default.
    for name in PREFILL_DROPS:
        if name in fields:
            setattr(leg, name, fields[name].default)
    for name, value in PREFILL_SETS.items():
        setattr(leg, name, value)
    if getattr(leg, "max_completion_tokens", None) is not None:
        leg.max_completion_tokens = 1
    leg.kv_transfer_params = kv_params.prefill(signer, mode, transfer_id(request), prompt_count(request))
    prompts = _prompts(request) if mode == "pull" else None
    return [leg] if prompts is None else [leg.model_copy(update={"prompt": p}) for p in prompts]


def decode_leg(request, mode: Literal["push", "pull"], signer: ParamsSigner, *, peer: dict[str, Any] | None = None,
               answers: list[Any] | None = None):
    """``peer``: the P replica's metadata (push); ``answers``: P's answer to each of
    ``prefill_legs`` (pull), None where P gave none."""
    leg = request.model_copy(deep=True)
    tid = transfer_id(request)
    if mode == "push":
        ours = (peer or {}).get(PEER_KEY)
        if not isinstance(ours, dict) or ":" not in str(ours.get("side_channel", "")):
            raise ValueError(f"the prefill replica published no neuron_disagg side channel (got {peer!r}): does "
                             "the prefill deployment run the NeuronDisaggConnector with its Ray backend?")
        leg.kv_transfer_params = kv_params.push_decode(signer, tid, ours["side_channel"], int(ours["tp"]),
                                                       prompt_count(request))
        return leg
    offers = [getattr(answer, "kv_transfer_params", None) for answer in answers or [None]]
    complete = all(isinstance(o, dict) and isinstance(o.get("offer"), str) for o in offers)
    leg.kv_transfer_params = kv_params.pull_decode(signer, tid, offers) if complete else None
    return leg
