"""Scripted stand-ins for vLLM prefill and decode instances: real aiohttp servers on 127.0.0.1
that speak the OpenAI completions API, record what they were sent (``kv_transfer_params``,
headers, when it arrived and ended, whether the router hung up) and can be told to fail, hang,
hold, or die.

``KvBoard`` stands in for the KV transfer: a fake P marks a transfer id ready when it finishes;
a fake D in push mode waits for that mark before its first token, like the real connector.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from neuron_disagg.kv_params import KEY, ParamsSigner

SECRET = b"router-tests-deployment-secret-0123456789"
SIGNER = ParamsSigner(SECRET)  # the router under test signs with it; the fakes verify as the connector does


class KvBoard:
    def __init__(self) -> None:
        self.ready: dict[str, asyncio.Event] = defaultdict(asyncio.Event)


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    headers: Any  # case-insensitive
    at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    cancelled: bool = False
    chunks_sent: int = 0

    @property
    def params(self) -> dict[str, Any]:
        """The kv_transfer_params sent, checked as the connector checks ours (a bad signature or
        unsigned params of ours raise); vLLM's connectors' as they are."""
        params = self.body.get("kv_transfer_params") or {}
        return SIGNER.verify(params) if KEY in params else params

    @property
    def transfer_id(self) -> str | None:
        """Ours carry it in kv_transfer_params; vLLM's connectors match legs by X-Request-Id."""
        return self.params.get("transfer_id") or self.headers.get("X-Request-Id")

    @property
    def reference(self) -> bool:
        return "do_remote_decode" in self.params or "do_remote_prefill" in self.params


class FakeVllm:
    def __init__(self, role: str, board: KvBoard, name: str = ""):
        self.role, self.board, self.name = role, board, name or role
        self.requests: list[Received] = []
        self.active = 0  # completion handlers running now
        self.other: list[tuple[str, Any]] = []  # (path, headers) of non-completion calls
        # Behaviour, changed by tests while the server runs:
        self.hold: asyncio.Event | None = None   # completions wait for it before anything else
        self.fail_status: int | None = None      # then answer with this status
        self.fail_body: dict | None = None       # and this body (default: vLLM's older error shape)
        self.hang = False                        # or never answer
        self.wait_for_kv = True                  # D in push mode: wait for P's mark
        self.chunks = 3                          # D: streamed text chunks before [DONE]
        self.chunk_gate: asyncio.Queue | None = None  # D: one item per chunk after the first
        self.chunk_interval_s = 0.0              # D: simulated time per decoded token
        self.stream_then_die_after: int | None = None  # D: break the connection after N chunks
        self.omit_kv_params = False              # P in pull mode: answer without them
        self.reset_next = 0                      # drop this many requests' connections unanswered
        # drop, unanswered, a request on a connection an earlier request used (as a server resuming
        # from a pause longer than its keep-alive timeout drops every idle one); new ones are served
        self.drop_kept_alive = False
        self._used_connections: set = set()      # their aiohttp protocols (held: a test is short)
        self.dropped = 0                         # requests dropped so (reset_next aside)
        self.health_ok = True
        self.awake = asyncio.Event()             # cleared: stopped (SIGSTOP): answers nothing, streams nothing
        self.awake.set()
        self.running, self.waiting, self.kv_usage = 0, 0, 0.0  # what /metrics says
        self.connector_role: str | None = role  # neuron_disagg_role on /metrics (None: not exported)
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reference_params(self) -> dict[str, Any]:
        """What vLLM's NixlConnector P answers with (the fields a D needs to read)."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8],
                "remote_engine_id": f"engine-{self.name}", "remote_request_id": "cmpl-x-0",
                "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}

    def pull_params(self, prompt: Any = None) -> dict[str, Any]:
        """What our connector's P answers in pull mode: its signed offer for the (first) prompt."""
        token = base64.b64encode(json.dumps([self.name, prompt]).encode()).decode()
        return {"neuron_disagg": 1, "offer": token}

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> FakeVllm:
        app = web.Application(middlewares=[self._connection_seen])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._tokenize)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Dies: the port refuses connections until ``start`` again (same port)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _connection_seen(self, request: web.Request, handler):
        await self.awake.wait()
        kept_alive = request.protocol in self._used_connections
        self._used_connections.add(request.protocol)
        if kept_alive and self.drop_kept_alive:
            self.dropped += 1
            assert request.transport is not None
            request.transport.abort()
            await asyncio.Event().wait()
        return await handler(request)

    # -- endpoints --------------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rec = Received(request.path, body, request.headers.copy())
        self.requests.append(rec)
        self.active += 1
        try:
            return await self._answer(request, rec)
        except asyncio.CancelledError:
            rec.cancelled = True
            raise
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request, rec: Received) -> web.StreamResponse:
        if self.reset_next:  # as a server resuming from a long pause drops its kept-alive connections
            self.reset_next -= 1
            assert request.transport is not None
            request.transport.abort()
            await asyncio.Event().wait()
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_status is not None:
            return web.json_response(self.fail_body or {"object": "error", "message": f"{self.name} failed on purpose",
                                                        "code": self.fail_status}, status=self.fail_status)
        if self.hang:
            await asyncio.Event().wait()
        tid = rec.transfer_id or ""
        if self.role == "prefill":
            self.board.ready[tid].set()
            rec.finished_at = time.monotonic()
            answer = _completion(rec, "P", self.name)
            if self.omit_kv_params:
                answer["kv_transfer_params"] = None
            elif rec.reference:
                answer["kv_transfer_params"] = self.reference_params()
            elif rec.params.get("mode") == "pull":
                prompt = rec.body.get("prompt")
                answer["kv_transfer_params"] = self.pull_params(prompt[0] if isinstance(prompt, list) and prompt
                                                                and isinstance(prompt[0], (str, list)) else prompt)
            else:
                answer["kv_transfer_params"] = None
            return web.json_response(answer)
        pushed = rec.params.get("mode") == "push" or (rec.reference and "remote_block_ids" not in rec.params)
        if pushed and self.wait_for_kv:
            await self.board.ready[tid].wait()
        if not rec.body.get("stream"):
            rec.finished_at = time.monotonic()
            return web.json_response(_completion(rec, "hello world", self.name))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.chunks):
            if i and self.chunk_gate is not None:
                await self.chunk_gate.get()
            if i and self.chunk_interval_s:
                await asyncio.sleep(self.chunk_interval_s)  # decode time, not a wait for a state
            await self.awake.wait()
            if self.stream_then_die_after is not None and i == self.stream_then_die_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            chunk = _completion(rec, f"tok{i} ", self.name)
            if i == 0:
                chunk["x_service_s"] = time.monotonic() - rec.at  # for the load test
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            rec.chunks_sent += 1
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        rec.finished_at = time.monotonic()
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.health_ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = '{engine="0",model_name="fake-model"}'
        text = (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {self.running}\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} {self.waiting}\n"
                f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{labels} {self.kv_usage}\n")
        if self.connector_role is not None:
            role = f'{{engine="0",model_name="fake-model",role="{self.connector_role}"}}'
            text += f"# TYPE neuron_disagg_role gauge\nneuron_disagg_role{role} 1.0\n"
        return web.Response(text=text, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        self.other.append((request.path, request.headers.copy()))
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "owned_by": self.name}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.other.append((request.path, request.headers.copy()))
        body = await request.json()
        if request.path == "/tokenize":
            tokens = list(range(len(body.get("prompt", "").split())))
            return web.json_response({"tokens": tokens, "count": len(tokens), "served_by": self.name})
        return web.json_response({"prompt": " ".join(map(str, body.get("tokens", []))),
                                  "served_by": self.name})


def _completion(rec: Received, text: str, name: str) -> dict[str, Any]:
    if rec.path.endswith("/chat/completions"):
        return {"id": "chatcmpl-1", "object": "chat.completion", "model": rec.body.get("model"),
                "served_by": name, "choices": [{"index": 0, "message": {"role": "assistant",
                                                                        "content": text},
                                                "finish_reason": "length"}]}
    return {"id": "cmpl-1", "object": "text_completion", "model": rec.body.get("model"),
            "served_by": name, "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
