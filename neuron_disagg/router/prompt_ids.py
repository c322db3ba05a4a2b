"""A request's prompt as the token ids vLLM will compute, for matching against what instances hold.

Token ids a client sent are taken as they are. Text needs the model's tokenizer (``--tokenizer``,
loaded once at startup with ``transformers``, which every vLLM environment has): a completion's
prompt is encoded as vLLM encodes it (special tokens added), a chat's messages through the
tokenizer's chat template with the generation prompt, as vLLM's chat endpoint applies it by
default. Where this router cannot know the ids (no tokenizer, a list of several prompts, a chat with
tools or images, a cache salt), ``ids`` answers None and the request is routed by load alone. A tokenization that
differs from vLLM's costs hits, never correctness: each instance computes what it does not hold.
"""

from __future__ import annotations

from typing import Any

from .requests import ClientRequest


class PromptIds:
    def __init__(self, tokenizer: str | None = None):
        self._tokenizer: Any = None
        if tokenizer is not None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ValueError("--tokenizer needs the transformers package (every vLLM environment has it): "
                                 "run the router from the instances' environment, or install transformers") from None
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(tokenizer)
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot load the tokenizer {tokenizer!r}: {exc}") from None

    def tokenizes(self, req: ClientRequest) -> bool:
        """Whether ``ids`` would run the tokenizer (text to encode), rather than answer at once."""
        return self._tokenizer is not None and (req.path.endswith("/chat/completions")
                                                or isinstance(req.body.get("prompt"), str))

    def ids(self, req: ClientRequest) -> list[int] | None:
        body = req.body
        if body.get("cache_salt"):  # salted blocks hash apart from everyone's: nothing to match
            return None
        if req.path.endswith("/chat/completions"):
            return self._chat(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, str) and self._tokenizer is not None:
            return list(self._tokenizer(prompt, add_special_tokens=body.get("add_special_tokens", True))["input_ids"])
        return None

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if self._tokenizer is None or body.get("tools") or not isinstance(messages, list):
            return None
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            return None  # content parts (images, audio): vLLM's template input is not ours to rebuild
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False))
        except Exception:  # a template that refuses these messages: vLLM will say why, to the client
            return None
        return list(self._tokenizer(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"])
