"""Two tiers (README): the fast check, ``pytest -m "not integration and not slow"``, and the whole
suite (two pytest-xdist workers: what waits on a server or a lease in one overlaps the other's work).

A test that starts a process, a server process or another environment is marked ``integration``
(every test under tests/integration is, by its directory); one that runs in-process but for
seconds by design (a load test, a long property or simulation run) is marked ``slow``. Every test
not marked ``integration`` follows two rules:

- each of its tests gets ``FAST_TIMEOUT_S`` (a hung one stalls the check for seconds, not the
  ten minutes integration tests may take);
- it may not start a process: every way Python starts one (``subprocess`` and ``asyncio``
  subprocesses, multiprocessing's spawn, ``os.fork``, ``posix_spawn``) fails such a test, naming
  the marker it needs.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from pathlib import Path

import pytest

FAST_TIMEOUT_S = 30
INTEGRATION = Path(__file__).parent / "integration"
#: Fixtures that start processes (moto's server, vLLM servers, NIXL peers): a test using one is an
#: integration test wherever it lives (a session fixture starts before this module's guard).
PROCESS_FIXTURES = {"moto_url", "cluster", "routed", "ucx_peers", "fabric"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION in Path(item.fspath).parents or PROCESS_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("integration") is None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FAST_TIMEOUT_S))
        item.add_marker(pytest.mark.xdist_group(_group(item)))


def _group(item) -> str:
    """What must run in one pytest-xdist worker (the README's full suite runs two, ``--dist
    loadgroup``): the tests sharing the vLLM clusters (tests/integration/conftest.py), and each
    other module's tests, which may share module fixtures; a fixture is built once per worker."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).get("cluster")
    if defs and defs[-1].scope == "package":
        return "vllm-clusters"
    return item.nodeid.split("::", 1)[0]


@pytest.fixture(autouse=True)
def fast_tests_start_no_process(request, monkeypatch):
    if request.node.get_closest_marker("integration") is not None:
        yield
        return

    def refused(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.integration "
                             "(the fast tier runs none)")

    for module, name in ((subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"),
                         (os, "posix_spawn"), (os, "posix_spawnp")):
        monkeypatch.setattr(module, name, refused)
    yield
