"""The libcuda stub as the package builds it (for `neuron-disagg install-fabric-libs`, which puts it
beside the other libraries NIXL's LIBFABRIC plugin needs on Neuron hosts: test_fabric_libs.py)."""

from __future__ import annotations

import ctypes
import subprocess

import pytest

from neuron_disagg.platforms import libcuda_stub

pytestmark = pytest.mark.integration  # compiles the stub with the C compiler


def test_builds_checks_and_answers_no_device(tmp_path):
    library = libcuda_stub.build(tmp_path / "lib")
    lib = ctypes.CDLL(str(library))
    assert all(hasattr(lib, name) for name in libcuda_stub.SYMBOLS)
    assert not hasattr(lib, "cuInit")  # how a real driver is told from the stub
    assert lib.cuCtxSetCurrent(None) == 100
    soname = subprocess.run(["objdump", "-p", str(library)], capture_output=True, text=True).stdout
    assert "SONAME               libcuda.so.1" in soname


def test_a_second_build_keeps_the_library_and_a_changed_source_rebuilds(tmp_path, monkeypatch):
    directory = tmp_path / "lib"
    first = libcuda_stub.build(directory).stat().st_mtime_ns
    assert libcuda_stub.build(directory).stat().st_mtime_ns == first
    changed = tmp_path / "libcuda_stub.c"
    changed.write_text(libcuda_stub.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(libcuda_stub, "SOURCE", changed)
    libcuda_stub.build(directory)
    assert len(list(directory.glob(".built-from-*"))) == 1
    assert libcuda_stub._stamp(directory).exists()


def test_a_stub_that_answers_wrongly_is_refused(tmp_path, monkeypatch):
    wrong = tmp_path / "wrong.c"
    wrong.write_text(libcuda_stub.SOURCE.read_text().replace("#define CUDA_ERROR_NO_DEVICE 100",
                                                             "#define CUDA_ERROR_NO_DEVICE 0"))
    monkeypatch.setattr(libcuda_stub, "SOURCE", wrong)
    with pytest.raises(libcuda_stub.StubError, match="answered"):
        libcuda_stub.build(tmp_path / "lib")
    assert not (tmp_path / "lib" / "libcuda.so.1").exists()


def test_refuses_a_host_with_a_real_driver(tmp_path, monkeypatch):
    monkeypatch.setattr(libcuda_stub, "real_libcuda_loads", lambda: True)
    with pytest.raises(libcuda_stub.StubError, match="would hide it"):
        libcuda_stub.build(tmp_path / "lib")
    assert not (tmp_path / "lib").exists()
