"""Two tiers (README): the fast check, ``pytest -m "not integration and not slow"``, and the whole
suite, in two pytest-xdist workers: one runs every test that starts vLLM servers, one set of
servers at a time (memory: about 2 GB per instance), and the other everything else beside it
(``pytest_xdist_make_scheduler`` below).

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
from hypothesis import settings

FAST_TIMEOUT_S = 30
# Hypothesis's per-example deadline (200 ms) times the machine, not the code: one example stalled by
# the other worker's vLLM servers failed a test. The tests' own bounds stay.
settings.register_profile("no-deadline", deadline=None)
settings.load_profile("no-deadline")
# The processes the suite starts (vLLM's, Ray's, NIXL peers: hundreds) write the bytecode of what
# they import from outside the environments (this package, editable; the tests), which set-up
# byte-compiled, even where the machine sets PYTHONDONTWRITEBYTECODE.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
INTEGRATION = Path(__file__).parent / "integration"
#: Fixtures that start processes (moto's server, vLLM servers, NIXL peers): a test using one is an
#: integration test wherever it lives (a session fixture starts before this module's guard).
PROCESS_FIXTURES = {"moto_url", "cluster", "routed", "ucx_peers", "fabric"}


#: The tests that start vLLM servers, by test id: pytest-xdist's controller, which schedules, sees
#: ids only. Collection checks this against what each test uses (the ``vllm_servers`` marker or the
#: shared clusters of tests/integration/conftest.py), so it cannot go stale silently.
VLLM_SERVER_TESTS = tuple(f"tests/integration/{module}.py::" for module in (
    "test_vllm_push", "test_hung_peers", "test_vllm_request_shapes", "test_router_restart",
    "test_bench", "test_demo", "test_vllm_oldest", "test_ray_serve", "test_llm_d", "test_prefix_routing")) + (
    "tests/deploy/test_examples.py::test_local_cpu_example_serves_a_request_through_the_router",)
#: Of those, the ones that may run in the other worker, beside the clusters: a few instances of
#: their own (a P and a D), so at worst eight instances are up at once (measured peak 14.6 GiB).
#: Without them the servers' worker is the suite's critical path (1,361 s against 1,086, when 0.24's
#: module was the one beside them).
BESIDE_THE_CLUSTERS = ("tests/integration/test_vllm_oldest.py::", "tests/integration/test_demo.py::")
#: The shared clusters' parameters (tests/integration/conftest.py), in the order they run.
CLUSTER_ORDER = ("main", "0.29.0")


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the extended tier (tests marked `extended`: older vLLM versions; "
                          "scripts/extended.sh builds what it needs and runs it)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--extended"):  # out of CI's time: scripts/extended.sh runs them
        extended = [item for item in items if item.get_closest_marker("extended")]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if not item.get_closest_marker("extended")]
    for item in items:
        if INTEGRATION in Path(item.fspath).parents or PROCESS_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("integration") is None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FAST_TIMEOUT_S))
        starts_servers = item.get_closest_marker("vllm_servers") is not None or _uses_shared_cluster(item)
        if starts_servers != item.nodeid.startswith(VLLM_SERVER_TESTS):
            raise pytest.UsageError(
                f"{item.nodeid} {'starts' if starts_servers else 'starts no'} vLLM servers, but "
                f"tests/conftest.py's VLLM_SERVER_TESTS says otherwise: update the list")


class OneClusterAtATime:
    """Runs the tests of each shared cluster (tests/integration/conftest.py's ``cluster``, one per
    vLLM version) together, after every other test, so each cluster starts once. pytest's own
    reordering interleaved them across modules (the 0.32 cluster, then 0.29's, then 0.32's again
    and 0.29's again: six vLLM starts too many, about 300 s of CPU), and Ray's cluster ran while
    0.29's was up."""

    @pytest.hookimpl(trylast=True)  # after pytest's reordering by fixture parameters
    def pytest_collection_modifyitems(self, items):
        items[:] = sorted(items, key=self._cluster_rank)  # stable: each group keeps its order

    @staticmethod
    def _cluster_rank(item) -> int:
        if not _uses_shared_cluster(item):
            return 0
        version = item.callspec.getparam("cluster") if hasattr(item, "callspec") else None
        return 1 + CLUSTER_ORDER.index(version) if version in CLUSTER_ORDER else len(CLUSTER_ORDER) + 1


def pytest_configure(config):
    config.pluginmanager.register(OneClusterAtATime(), "one-cluster-at-a-time")


def _uses_shared_cluster(item) -> bool:
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).get("cluster")
    return bool(defs) and defs[-1].scope == "package"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The README's full suite runs in two pytest-xdist workers. Every test that starts vLLM servers
    runs in one of them (but ``BESIDE_THE_CLUSTERS``), so that one set of servers is up at a time: a
    cluster and its spares are seven instances of about 1.7 GB each, and two such sets at once came
    within 1 GB of this machine's 24 GiB. Every other module's tests run together in either (they
    may share module fixtures). The largest unit, the servers' tests, starts first (xdist orders units by size)."""
    from xdist.scheduler import LoadScopeScheduling

    class VllmServersInOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            together = nodeid.startswith(VLLM_SERVER_TESTS) and not nodeid.startswith(BESIDE_THE_CLUSTERS)
            return "vllm-servers" if together else nodeid.split("::", 1)[0]

    return VllmServersInOneWorker(config, log)


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
