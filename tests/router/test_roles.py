"""The router checks each instance's role against the role its connector runs (``neuron_disagg_role``
on its /metrics): it refuses to start with one that differs, refuses to add one, and ejects one that
changes, naming the URL and both roles. Instances that export no role are not checked."""

from __future__ import annotations

import pytest

from neuron_disagg.router.health import RoleMismatch, parse_roles
from neuron_disagg.router.instances import make_instance
from neuron_disagg.router.server import start_router
from neuron_disagg.router.settings import RouterSettings

from .conftest import SIGNER, cluster, completion, until
from .fakes import FakeVllm, KvBoard


async def test_the_router_refuses_to_start_with_its_prefill_and_decode_swapped():
    board = KvBoard()
    p, d = await FakeVllm("prefill", board, "p").start(), await FakeVllm("decode", board, "d").start()
    swapped = [make_instance("prefill", d.url, "127.0.0.1:5600", 1, 5600), make_instance("decode", p.url, None, None, 5600)]
    try:
        with pytest.raises(RoleMismatch) as refused:
            await start_router(RouterSettings.build(connect_timeout_s=2.0), swapped, signer=SIGNER)
        message = str(refused.value)
        assert f"{d.url} was given as prefill (--prefill), but its connector runs as decode" in message
        assert f"{p.url} was given as decode (--decode), but its connector runs as prefill" in message
        assert not p.requests and not d.requests
    finally:
        await p.stop()
        await d.stop()


async def test_an_instance_that_changes_role_is_ejected_and_one_added_wrong_is_refused():
    async with cluster(prefill=1, decode=2, health_interval_s=0.05, health_timeout_s=0.5) as c:
        d0 = c.decodes[0]
        d0.connector_role = "prefill"  # restarted as a P behind the same address
        await until(lambda: not c.instance(d0).healthy, "d0 to be ejected")
        status, body = await c.admin("GET")
        listed = next(i for i in body["instances"] if i["url"] == d0.url)
        assert "given as decode" in listed["role_mismatch"] and "runs as prefill" in listed["role_mismatch"]
        for _ in range(3):
            assert (await c.post("/v1/completions", completion()))[0] == 200
        assert not d0.requests
        d0.connector_role = "decode"
        await until(lambda: c.instance(d0).healthy, "d0 to be readmitted")
        wrong = await FakeVllm("prefill", c.board, "p-new").start()
        try:
            status, body = await c.admin("POST", {"role": "decode", "url": wrong.url})
            assert status == 409 and body["error"]["code"] == "role_mismatch"
            assert f"{wrong.url} was given as decode" in body["error"]["message"]
            assert wrong.url not in [i["url"] for i in (await c.admin("GET"))[1]["instances"]]
        finally:
            await wrong.stop()


async def test_an_instance_that_exports_no_role_is_served_unchecked():
    async with cluster(prefill=1, decode=1, health_interval_s=0.05) as c:
        for fake in c.prefills + c.decodes:
            fake.connector_role = None
        before = c.router.metrics.registry.get_sample_value(
            "neuron_disagg_router_instance_healthy", {"role": "decode", "url": c.decodes[0].url})
        assert before == 1.0
        assert (await c.post("/v1/completions", completion()))[0] == 200
        assert all(c.instance(f).healthy and not c.instance(f).role_mismatch for f in c.prefills + c.decodes)


def test_roles_are_read_from_the_connectors_gauge_only():
    page = ('# TYPE neuron_disagg_role gauge\nneuron_disagg_role{engine="0",role="decode"} 1.0\n'
            '# TYPE neuron_disagg_held_blocks gauge\nneuron_disagg_held_blocks{engine="0",role="prefill"} 0.0\n')
    assert parse_roles(page) == {"decode"}
    assert parse_roles("vllm:num_requests_running 1\n") == set()
    assert parse_roles("not a metrics page {") == set()
