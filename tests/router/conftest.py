"""Runs ``async def`` tests in a fresh event loop each (no pytest-asyncio needed), and builds a
router in front of fake P and D instances: ``async with cluster(prefill=2, decode=1) as c``."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from neuron_disagg.router import RouterSettings, RunningRouter, start_router
from neuron_disagg.router.instances import make_instance

from .fakes import SECRET, SIGNER, FakeVllm, KvBoard

TEST_TIMEOUT_S = 30.0


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), TEST_TIMEOUT_S))
    return True


async def until(condition: Callable[[], Any], what: str, timeout_s: float = 5.0) -> Any:
    """Polls ``condition`` until it is truthy; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.005)


@dataclass
class Cluster:
    router: RunningRouter
    prefills: list[FakeVllm]
    decodes: list[FakeVllm]
    board: KvBoard
    client: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.router.url

    def instance(self, fake: FakeVllm):
        return next(i for i in self.router.pool.all() if i.url == fake.url)

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None,
                   raw: bytes | None = None) -> tuple[int, Any, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.client.post(self.url + path, data=data, headers={
                "Content-Type": "application/json", **(headers or {})}) as resp:
            text = await resp.text()
            try:
                payload = json.loads(text)
            except ValueError:
                payload = text
            return resp.status, resp.headers.copy(), payload

    async def admin(self, method: str, body: Any = None, headers: dict[str, str] | None = None):
        async with self.client.request(method, self.url + "/admin/instances", json=body,
                                       headers=headers) as resp:
            return resp.status, await resp.json()

    async def stream(self, body: dict[str, Any], path: str = "/v1/completions",
                     headers: dict[str, str] | None = None) -> list[str]:
        """Sends a streaming request; returns the SSE data lines."""
        async with self.client.post(self.url + path, json={**body, "stream": True},
                                    headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return [line.decode().strip()[len("data: "):] async for line in resp.content
                    if line.startswith(b"data: ")]


def completion(prompt: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 16, **extra}


@asynccontextmanager
async def cluster(prefill: int = 1, decode: int = 1, signed: bool = True, codec: Any = None,
                  p_side_channel: tuple[str, int] | None = None, **settings: Any) -> AsyncIterator[Cluster]:
    """``p_side_channel``: (address, tp) of the first P instead of a made-up one; ``codec``: the
    router signs the Withdraw it sends P with it (none: it sends none)."""
    board = KvBoard()
    prefills = [await FakeVllm("prefill", board, f"p{i}").start() for i in range(prefill)]
    decodes = [await FakeVllm("decode", board, f"d{i}").start() for i in range(decode)]
    settings = {"health_interval_s": 3600.0, "connect_timeout_s": 2.0, **settings}
    instances = [make_instance("prefill", f.url, f"127.0.0.1:{5600 + i}", i + 1, 5600, f"engine-p{i}")
                 for i, f in enumerate(prefills)]
    if p_side_channel is not None:
        instances[0] = make_instance("prefill", prefills[0].url, *p_side_channel, 5600, "engine-p0")
    instances += [make_instance("decode", f.url, None, None, 5600) for f in decodes]
    router = await start_router(RouterSettings.build(**settings), instances, shutdown_timeout_s=0.5,
                                signer=SIGNER if signed else None, codec=codec)
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
    try:
        yield Cluster(router, prefills, decodes, board, client)
    finally:
        await client.close()
        await router.close()
        for fake in prefills + decodes:
            await fake.stop()


@asynccontextmanager
async def router_process(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[tuple[str, list[str]]]:
    """Runs ``neuron-disagg router --port 0 ARGS`` as a process; yields (its URL, its log lines so
    far, still filling). On exit: SIGTERM, and the exit status must be 0."""
    import os
    import signal
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "neuron_disagg.cli", "router", "--port", "0", *args,
        env={**os.environ, "NEURON_DISAGG_SECRET": SECRET.decode(), **(env or {})}, stderr=asyncio.subprocess.PIPE)
    lines: list[str] = []
    drain = None
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 20
        url = None
        while url is None:
            line = await asyncio.wait_for(proc.stderr.readline(), max(0.1, deadline - time.monotonic()))
            assert line, f"router exited early: {''.join(lines)}"
            lines.append(line.decode())
            match = re.search(r"router on (http://\S+),", lines[-1])
            url = match and match.group(1)
        drain = asyncio.create_task(_collect(proc.stderr, lines))
        yield url, lines
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0, "".join(lines)
        await drain
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if drain is not None and not drain.done():
            drain.cancel()


async def _collect(stream: asyncio.StreamReader, lines: list[str]) -> None:
    async for line in stream:
        lines.append(line.decode())
