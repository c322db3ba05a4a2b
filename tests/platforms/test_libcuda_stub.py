"""The libcuda stub as the package builds it (`neuron-disagg install-libcuda-stub`) and as
`neuron-disagg serve` uses it on Neuron hosts (recorded trn2 tree) — not only on our AMI."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from neuron_disagg.config import Config, ConfigError
from neuron_disagg.platforms import libcuda_stub
from neuron_disagg.vllm import serve


@pytest.fixture
def stub_dirs(tmp_path, monkeypatch):
    """Point both search places at empty temporary directories."""
    system, user = tmp_path / "opt", tmp_path / "cache"
    monkeypatch.setattr(libcuda_stub, "SYSTEM_DIR", system)
    monkeypatch.setenv("NEURON_DISAGG_CACHE", str(user))
    return system, user / "libcuda-stub"


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


def test_the_command_installs_where_serve_finds_it(stub_dirs, monkeypatch):
    system, user = stub_dirs
    assert libcuda_stub.find() is None
    done = subprocess.run([sys.executable, "-m", "neuron_disagg.cli", "install-libcuda-stub", "--dir", str(user)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "built and checked" in done.stdout
    assert libcuda_stub.find() == user


def _neuron_config():
    return Config(platform="neuron", backend="LIBFABRIC")


def test_serve_on_neuron_puts_the_stub_on_vllms_library_path(host, stub_dirs, monkeypatch):
    root, _ = host("trn2")
    monkeypatch.setattr("cuda_compat.libcuda_present", lambda: False)
    with pytest.raises(ConfigError, match="install-libcuda-stub"):
        serve.library_env(_neuron_config(), {}, root)
    system, _ = stub_dirs
    libcuda_stub.build(system)
    env = serve.library_env(_neuron_config(), {"LD_LIBRARY_PATH": "/opt/aws/neuron/lib", "HOME": "/h"}, root)
    assert env == {"LD_LIBRARY_PATH": f"{system}:/opt/aws/neuron/lib", "HOME": "/h"}


def test_serve_leaves_the_environment_alone_where_no_stub_is_needed(host, stub_dirs, monkeypatch):
    root, _ = host("trn2")
    env = {"LD_LIBRARY_PATH": "/x"}
    monkeypatch.setattr("cuda_compat.libcuda_present", lambda: True)  # e.g. a stub already on the path
    assert serve.library_env(_neuron_config(), env, root) == env
    monkeypatch.setattr("cuda_compat.libcuda_present", lambda: False)
    assert serve.library_env(Config(platform="neuron", backend="UCX"), env, root) == env
    assert serve.library_env(Config(platform="cpu"), env, root) == env


def test_doctor_names_the_command_and_then_sees_the_stub(host, stub_dirs, monkeypatch):
    from neuron_disagg.doctor import check_libcuda
    from neuron_disagg.platforms.neuron import NeuronPlatform

    root, _ = host("trn2")
    monkeypatch.setattr("cuda_compat.libcuda_present", lambda: False)
    before = check_libcuda(NeuronPlatform(root), "LIBFABRIC")
    assert (before.status, before.fix) == ("fail", "sudo neuron-disagg install-libcuda-stub")
    libcuda_stub.build(stub_dirs[1])
    after = check_libcuda(NeuronPlatform(root), "LIBFABRIC")
    assert after.status == "ok" and str(stub_dirs[1]) in after.message
