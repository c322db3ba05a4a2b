"""What a client asked for, checked once, and the two leg bodies built from it.

``app.py`` calls ``parse_client_request`` on every /v1/completions and /v1/chat/completions body;
``flows.py`` calls ``prefill_body`` and ``decode_body`` for each attempt. Our modes'
``kv_transfer_params`` come from ``kv_params``, the contract the connector reads; vLLM's own
connectors' (``vllm-push``, ``vllm-pull``) are written here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .. import kv_params
from ..kv_params import ParamsSigner
from .errors import BadRequest, RouterError
from .settings import MODES, Mode

# P's answer is discarded, so P generates one token and does not stream; options that only make
# sense with streaming or with more tokens would make vLLM refuse P's leg. P computes each prompt
# once whatever D samples from it: n and best_of stay with D. (The Ray backend shapes its legs
# from these too.)
PREFILL_DROPS = ("stream_options", "min_tokens", "n", "best_of")
#: What P's leg sets; and max_completion_tokens to 1 where the client gave it (vLLM prefers it
#: over max_tokens for chat).
PREFILL_SETS = {"max_tokens": 1, "stream": False}


@dataclass(frozen=True)
class ClientRequest:
    path: str                    # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]         # the client's body without the router's own fields
    mode: Mode
    stream: bool
    prompt_tokens: int           # estimate, for picking P


def parse_client_request(path: str, raw: bytes, default_mode: Mode) -> ClientRequest:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}",
                         code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("field 'model' is required and must be a non-empty string",
                         code="missing_model")
    mode = body.pop("disagg_mode", default_mode)
    if mode not in MODES:
        raise BadRequest(f"field 'disagg_mode' must be one of {', '.join(MODES)}, got {mode!r}",
                         code="invalid_disagg_mode")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"field 'stream' must be true or false, got {stream!r}", code="invalid_stream")
    _refuse_prompt_logprobs(body)
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("field 'messages' is required and must be a non-empty list",
                             code="missing_messages")
        tokens = _chat_tokens(messages)
    else:
        if "prompt" not in body:
            raise BadRequest("field 'prompt' is required", code="missing_prompt")
        tokens = _prompt_tokens(body["prompt"])
    return ClientRequest(path, body, mode, stream, tokens)


def _refuse_prompt_logprobs(body: dict[str, Any]) -> None:
    """Prompt logprobs come from computing the prompt, which P does and D does not: D has none to
    give. Refused up front rather than answered without them."""
    asked = ("prompt_logprobs" if body.get("prompt_logprobs") is not None else
             "echo" if body.get("echo") and body.get("logprobs") is not None else None)
    if asked:
        raise BadRequest(f"'{asked}' asks for the prompt's logprobs, which a disaggregated request does not "
                         "compute where it decodes: drop it, or send the request to a monolithic vLLM",
                         code="prompt_logprobs_unsupported")


def distinct_prompts(body: dict[str, Any]) -> list[Any] | None:
    """A completion's prompts, each once, when it has several; None for one prompt (or chat)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], (str, list)):
        return None
    unique = list({json.dumps(p): p for p in prompt}.values())
    return unique if len(unique) > 1 or len(prompt) > 1 else None


def prefill_bodies(req: ClientRequest, mode: Mode, transfer_id: str,
                   signer: ParamsSigner | None) -> list[dict[str, Any]]:
    """P's legs: one body, or in pull mode one per distinct prompt of a list (P answers a request
    with one set of kv_transfer_params, the first prompt's, and D needs every prompt's offer)."""
    prompts = distinct_prompts(req.body) if mode == "pull" else None
    body = prefill_body(req, mode, transfer_id, signer)
    return [body] if prompts is None else [{**body, "prompt": p} for p in prompts]


def _text_tokens(text: str) -> int:
    return len(text) // 4  # ~4 characters per token; only the relative load matters


def _prompt_tokens(prompt: Any) -> int:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("field 'prompt' must not be empty", code="missing_prompt")
        return _text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if all(isinstance(p, str) for p in prompt):
            return sum(_text_tokens(p) for p in prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return sum(len(p) for p in prompt)
    raise BadRequest("field 'prompt' must be a non-empty string, list of strings, list of token "
                     "ids, or list of token-id lists", code="invalid_prompt")


def _chat_tokens(messages: list[Any]) -> int:
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'",
                             code="invalid_messages")
        content = message.get("content")
        if isinstance(content, str):
            total += _text_tokens(content)
        elif isinstance(content, list):  # content parts: count the text ones
            total += sum(_text_tokens(p.get("text", "")) for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
        total += 4  # role and template tokens
    return total


def require_signer(signer: ParamsSigner | None) -> ParamsSigner:
    """Our connector acts only on signed params: the router needs the deployment secret."""
    if signer is None:
        raise RouterError("this router was started without the deployment secret, which modes push and "
                          "pull need to sign kv_transfer_params: give it the instances' config (--config) "
                          "and secret (its secret_file, or the NEURON_DISAGG_SECRET environment variable)",
                          code="router_without_secret", status=503)
    return signer


def prefill_body(req: ClientRequest, mode: Mode, transfer_id: str, signer: ParamsSigner | None) -> dict[str, Any]:
    body = {k: v for k, v in req.body.items() if k not in PREFILL_DROPS}
    body.update(PREFILL_SETS)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if mode.startswith("vllm-"):  # vLLM's connectors match P and D by the X-Request-Id header
        body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    else:
        body["kv_transfer_params"] = kv_params.prefill(require_signer(signer), mode, transfer_id,
                                                       prompt_count(req.body))
    return body


def prompt_count(body: dict[str, Any]) -> int:
    """The distinct prompts of a request: what its signed params are good for (kv_params)."""
    return len(distinct_prompts(body) or [body])


def decode_body(req: ClientRequest, params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's body unchanged but for ``kv_transfer_params`` (a client's own are replaced:
    they steer the connector, so only the router may set them); None: none at all, a plain request
    D computes whole."""
    body = {k: v for k, v in req.body.items() if k != "kv_transfer_params"}
    return body if params is None else {**body, "kv_transfer_params": params}


def vllm_request_id(path: str, x_request_id: str) -> str:
    """The id vLLM's OpenAI server gives the engine request for a one-prompt body sent with this
    X-Request-Id header (before the engine's random suffix, which vLLM's connectors ignore)."""
    return f"chatcmpl-{x_request_id}" if path.endswith("/chat/completions") else f"cmpl-{x_request_id}-0"


def push_decode_params(mode: Mode, transfer_id: str, p_side_channel: str, p_tp: int, signer: ParamsSigner | None,
                       p_engine_id: str | None = None, path: str = "/v1/completions", prompts: int = 1) -> dict[str, Any]:
    if mode == "vllm-push":  # vLLM's D crashes its engine without remote_request_id
        host, _, port = p_side_channel.rpartition(":")
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": p_engine_id,
                "remote_request_id": vllm_request_id(path, transfer_id),
                "remote_host": host.strip("[]"), "remote_port": int(port), "tp_size": p_tp}
    return kv_params.push_decode(require_signer(signer), transfer_id, p_side_channel, p_tp, prompts)


def pull_decode_params(mode: Mode, transfer_id: str, p_params: list[dict[str, Any]],
                       signer: ParamsSigner | None) -> dict[str, Any]:
    """What P's legs returned as ``kv_transfer_params`` (one per leg): verbatim for vLLM's own
    connector; ours carries every leg's offer (one per prompt; D takes each prompt's own)."""
    if mode == "vllm-pull":
        return dict(p_params[0])
    return kv_params.pull_decode(require_signer(signer), transfer_id, p_params)
