"""Conversations as a client holds them: each sends its next turn only once the model has answered
the last, with that answer in the prompt (`vllm bench serve` sends fixed prompts, open loop, so a
turn there could not carry what the model said).

A workload (``load.Conversations``) is scripted once per seed (``script``): one system prompt, and
for every conversation and turn a user message, random token ids, so that each seed's prompts
share nothing with another's. ``converse`` plays it against a URL: requests start on a Poisson
schedule in turn order (turn 1 of every conversation, then turn 2...), a conversation's next turn
no earlier than its last answer, streaming, greedy, every answer exactly ``answer_tokens`` long;
it returns the figures `vllm bench serve` saves, under the same keys.

Prompts go as token ids, and the answer comes back as the ids vLLM generated (``return_token_ids``):
the tiny random model's text does not survive decoding and encoding again (its answers grew three-
to fourfold and the conversations outran the context), where a trained model's mostly does. So the
router here matches ids without tokenizing; what tokenizing costs it is measured apart.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx



@dataclass(frozen=True)
class Conversations:
    """The multi-turn workload (``converse``): ``conversations`` x ``turns`` requests, each
    turn's prompt the previous prompt, the model's answer to it (``answer_tokens``) and a new user
    message of ``user_tokens``, all after one system prompt of ``system_tokens``. ``hot_prefix``:
    instead, every request is the system prompt and a message of its own (one prefix for everything)."""

    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int
    hot_prefix: bool = False

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    @property
    def longest(self) -> int:
        return self.system_tokens + self.turns * self.user_tokens + (self.turns - 1) * self.answer_tokens


@dataclass(frozen=True)
class Script:
    system: list[int]
    users: list[list[list[int]]]  # [conversation][turn]: token ids


def script(tokenizer_dir: str, workload: Conversations, seed: int) -> Script:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = min(tokenizer.vocab_size, 30000)

    def ids(tokens: int) -> list[int]:
        out: list[int] = []
        while len(out) < tokens:
            t = rng.randrange(vocab // 20, vocab)
            if t not in special:
                out.append(t)
        return out

    return Script(ids(workload.system_tokens), [[ids(workload.user_tokens) for _ in range(workload.turns)]
                                                for _ in range(workload.conversations)])


@dataclass
class _Turn:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None
    answer: list[int] | None = None


async def _lines(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The stream's lines, split at newlines only: httpx's ``aiter_lines`` also splits at U+2028 and
    the like, which JSON leaves unescaped inside a string (the tiny model generates them)."""
    rest = b""
    async for chunk in resp.aiter_bytes():
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if rest:
        yield rest


async def _ask(client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> _Turn:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    turn, answer, first, last, count = _Turn(), [], None, None, 0
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return turn
        async for line in _lines(resp):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choices = json.loads(line[len(b"data: "):]).get("choices") or [{}]
            ids = choices[0].get("token_ids") or []
            if ids:
                last = time.perf_counter()
                first = first or last
                count += 1
                answer += ids
    if first is None or last is None:
        return turn
    turn.ttft_s, turn.e2el_s, turn.answer = first - started, last - started, answer
    turn.tpot_s = (last - first) / (count - 1) if count > 1 else None
    return turn


async def _converse(url: str, plan: Script, workload: Conversations, rate: float, seed: int) -> list[_Turn]:
    rng = random.Random(seed)
    starts, at = [], 0.0
    for _ in range(workload.requests):  # in turn order: turn t of conversation c is t * N + c
        at += rng.expovariate(rate) if rate != float("inf") else 0.0
        starts.append(at)
    done: list[_Turn] = []
    began = time.perf_counter()

    async def conversation(c: int, client: httpx.AsyncClient) -> None:
        history = plan.system
        for t in range(workload.turns):
            await asyncio.sleep(max(0.0, began + starts[t * workload.conversations + c] - time.perf_counter()))
            prompt = history + plan.users[c][t]
            turn = await _ask(client, url, prompt, workload.answer_tokens)
            done.append(turn)
            if turn.answer is None:
                return  # the rest of a failed conversation is not sent: counted failed below
            if not workload.hot_prefix:
                history = prompt + turn.answer

    limits = httpx.Limits(max_connections=workload.conversations + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(conversation(c, client) for c in range(workload.conversations)))
    return done


def converse(url: str, tokenizer_dir: str, workload: Conversations, rate: float, seed: int) -> dict:
    """Plays ``script(tokenizer_dir, workload, seed)`` against ``url`` at ``rate`` requests a second."""
    turns = asyncio.run(_converse(url, script(tokenizer_dir, workload, seed), workload, rate, seed))
    ok = [t for t in turns if t.ttft_s is not None]
    out: dict = {"completed": len(ok), "failed": workload.requests - len(ok)}
    for name in ("ttft", "tpot", "e2el"):
        values = sorted(getattr(t, f"{name}_s") * 1e3 for t in ok if getattr(t, f"{name}_s") is not None)
        if values:
            out[f"median_{name}_ms"] = statistics.median(values)
            out[f"p99_{name}_ms"] = values[min(len(values) - 1, max(0, round(0.99 * len(values)) - 1))]
    return out
