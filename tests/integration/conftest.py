import pytest

from .fabrics import libfabric, ucx


@pytest.fixture(scope="session", params=["UCX", "LIBFABRIC"])
def fabric(request, tmp_path_factory):
    """Each cross-process transfer test runs over both NIXL backends (see fabrics.py)."""
    pytest.importorskip("nixl", reason="the NIXL package is installed by scripts/setup.sh")
    made = ucx() if request.param == "UCX" else libfabric(tmp_path_factory.mktemp("libfabric"))
    yield made
    made.close()
