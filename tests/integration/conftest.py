import pytest

from ..vllm_envs import extra_env, main_env
from .fabrics import NIXL_RELEASES, libfabric, peers_on, ucx

# ./.venv's NIXL keeps the plain ids ("UCX", "LIBFABRIC"); the others name their release. A release
# marked extended runs in the extended tier only (CI's time).
FABRICS = [pytest.param((backend, release), id=backend if release.venv is None else f"{backend}-nixl-{release.version}",
                        marks=[pytest.mark.extended] if release.extended else [])
           for release in NIXL_RELEASES for backend in release.backends]


@pytest.fixture(scope="session", params=FABRICS)
def fabric(request, tmp_path_factory):
    """Each cross-process transfer test runs over both NIXL backends, on each NIXL release that
    backend can load here (see fabrics.py)."""
    pytest.importorskip("nixl", reason="the NIXL package is installed by scripts/setup.sh")
    backend, release = request.param
    pinned = None if release.venv is None else release
    made = ucx(pinned) if backend == "UCX" else libfabric(tmp_path_factory.mktemp("libfabric"), pinned)
    yield made
    made.close()


@pytest.fixture
def ucx_peers():
    """Starts P and D peer processes over UCX (for tests about what no fabric changes) and kills
    them after the test."""
    pytest.importorskip("nixl", reason="the NIXL package is installed by scripts/setup.sh")
    with peers_on(ucx()) as start:
        yield start


def pytest_collection_modifyitems(config, items):
    """On the other vLLM environments only what differs between versions runs: tests marked
    ``every_vllm`` (how each vLLM fans requests out, validates, streams, reports failed loads and
    metrics). Everything else — our threads, protocol and faults, which no vLLM version changes —
    runs on ./.venv's vLLM alone."""
    kept, dropped = [], []
    for item in items:
        param = getattr(getattr(item, "callspec", None), "params", {}).get("cluster", "main")
        (kept if param == "main" or item.get_closest_marker("every_vllm") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="package", params=["main", "0.29.0"], ids=lambda v: "vllm-main" if v == "main" else f"vllm-{v}")
def cluster(request):
    """A monolithic reference, P and D of one vLLM environment (tests/vllm_envs.py), shared by the
    vLLM-level test modules: ./.venv's vLLM (0.32), then 0.29's (``every_vllm`` tests only). The
    first's P streams by layers, the second's by steps (the default): every push test runs on each."""
    pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")
    from .vllm_cluster import running

    main = request.param == "main"
    with running(main_env() if main else extra_env(request.param), p_stream="layers" if main else None) as c:
        c.param = request.param  # which of this fixture's params it is (tests pick spares by it)
        yield c


@pytest.fixture(scope="package")
def routed(cluster):
    """The router in front of the cluster's P and D."""
    from .vllm_cluster import routed as started

    with started(cluster) as instance:
        yield instance


@pytest.fixture(autouse=True)
def nothing_left_held(request):
    """After every test on a vLLM cluster: P's and D's KV blocks back to none in use, and the
    connector's held-blocks gauge back to 0 (a leak fails the test that made it)."""
    yield
    if "cluster" in request.fixturenames:
        from .vllm_cluster import D_BOUND_S, TIMEOUTS, blocks_back, nothing_held

        cluster = request.getfixturevalue("cluster")
        blocks_back(cluster, timeout_s=D_BOUND_S + TIMEOUTS["lease_s"])
        nothing_held(cluster)
