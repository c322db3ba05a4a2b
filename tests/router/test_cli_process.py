"""``neuron-disagg router`` as a real process: it serves, requires its API key, logs the request
id, and exits 0 on SIGTERM."""

from __future__ import annotations

import aiohttp
import pytest

from .conftest import completion, router_process
from .fakes import FakeVllm, KvBoard

pytestmark = pytest.mark.integration  # the router in its own process


async def test_router_command_serves_and_stops_on_sigterm():
    board = KvBoard()
    p = await FakeVllm("prefill", board).start()
    d = await FakeVllm("decode", board).start()
    try:
        async with router_process("--prefill", p.url, "--decode", d.url, "--log-level", "DEBUG",
                                  env={"NEURON_DISAGG_ROUTER_API_KEY": "k3y"}) as (url, lines):
            assert "mode push" in lines[-1] and "API key required" in lines[-1]
            async with aiohttp.ClientSession() as client:
                async with client.post(url + "/v1/completions", json=completion()) as resp:
                    assert resp.status == 401
                async with client.post(url + "/v1/completions", json=completion(), headers={
                        "Authorization": "Bearer k3y", "X-Request-Id": "cli-1"}) as resp:
                    assert resp.status == 200 and resp.headers["X-Request-Id"] == "cli-1"
                    assert (await resp.json())["served_by"] == "decode"
        assert any("[cli-1]" in line and "transfer_id=cli-1." in line for line in lines), lines
    finally:
        await p.stop()
        await d.stop()
