"""What NIXL's LIBFABRIC plugin needs on a host without CUDA (a Neuron host), and who provides it.

The failure, reproduced: in a private mount namespace that hides this machine's CUDA toolkit
(/usr/local/cuda*), with only libfabric on the library path — as the EFA installer leaves a Neuron
DLAMI — the libcuda stub that set-up used to install is not enough: the plugin also lacks
libcudart.so.13 and libhwloc.so.15, and the backend does not load. ``neuron-disagg
install-fabric-libs`` provides them, and then it loads. And how ``serve`` and ``doctor`` use it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from neuron_disagg.config import Config, ConfigError
from neuron_disagg.platforms import fabric_libs
from neuron_disagg.vllm import serve

from ..integration.fabrics import NEWEST_NIXL, libfabric_alone, libfabric_libs

HIDE_CUDA = 'for d in /usr/local/cuda*; do [ -L "$d" ] || mount -t tmpfs none "$d"; done; exec "$@"'
DRIVER = r"""
import json, pathlib, sys
from neuron_disagg.platforms import fabric_libs, libcuda_stub
stub, target = map(pathlib.Path, sys.argv[1:3])
libcuda_stub.build(stub)  # what set-up installed before: the libcuda stub alone
out = {"before": fabric_libs.loads(stub), "missing": fabric_libs.missing(fabric_libs.plugin(), stub)}
out["provided"] = fabric_libs.install(target)
out["after"] = fabric_libs.loads(target)
print(json.dumps(out))
"""


@pytest.mark.integration  # a mount namespace in a child process
def test_without_a_cuda_runtime_the_stub_alone_fails_and_install_fabric_libs_makes_it_load(tmp_path):
    env_dir = libfabric_alone(tmp_path / "efa-lib")
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", HIDE_CUDA, "sh",
         sys.executable, "-c", DRIVER, str(tmp_path / "stub"), str(tmp_path / "fabric-libs")],
        capture_output=True, text=True, timeout=900,
        env={**_clean_env(), "LD_LIBRARY_PATH": str(env_dir)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] != "loaded", "with only the stub the plugin must not load: the failure to reproduce"
    assert {"libcudart.so.13", "libhwloc.so.15"} <= set(out["missing"]), out
    assert {"libcuda.so.1", "libcudart.so.13", "libhwloc.so.15"} == set(out["provided"]), out
    assert out["after"] == "loaded", out
    assert (tmp_path / "fabric-libs" / fabric_libs.STAMP).exists()


ABI_DRIVER = r"""
import json, pathlib, sys
from neuron_disagg.platforms import fabric_libs
try:
    print(json.dumps({"provided": fabric_libs.install(pathlib.Path(sys.argv[1]))}))
except fabric_libs.FabricLibsError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.integration  # NIXL 1.5.1 lives in another environment
@pytest.mark.parametrize("nixl", ["1.4.1", pytest.param(NEWEST_NIXL.version, marks=pytest.mark.extended)])
def test_a_libfabric_too_old_for_the_nixl_plugin_is_named_with_the_nixl_that_fits(tmp_path, nixl):
    """NIXL 1.5.1's plugin was linked against libfabric 2.7.0 (FABRIC_1.10); the libfabric here,
    2.1.0, stops at FABRIC_1.8, as the EFA installer 1.50.0's 2.6.0 stops at FABRIC_1.9."""
    python = sys.executable if nixl == "1.4.1" else NEWEST_NIXL.python
    done = subprocess.run([python, "-c", ABI_DRIVER, str(tmp_path / "fabric-libs")], capture_output=True, text=True,
                          timeout=600, env={**_clean_env(), "LD_LIBRARY_PATH": libfabric_libs(),
                                            "NEURON_DISAGG_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if nixl == "1.4.1":
        assert out == {"provided": []}  # everything already on the path, and the ABI it needs is there
    else:
        assert "needs libfabric ABI FABRIC_1.10 (libfabric >= 2.7.0, EFA installer >= 1.51.0)" in out["error"], out
        assert "`nixl==1.5.0`" in out["error"], out


def test_doctor_names_the_libfabric_abi_a_nixl_build_lacks(host, lib_dirs, monkeypatch):
    from neuron_disagg import doctor
    from neuron_disagg.platforms.neuron import NeuronPlatform

    root, _ = host("trn2")
    monkeypatch.setattr(fabric_libs, "loads", lambda directory, python=sys.executable: "nixlNotFoundError")
    monkeypatch.setattr(fabric_libs, "plugin", lambda python=None: "libplugin_LIBFABRIC.so")
    monkeypatch.setattr(fabric_libs, "abi_lacking", lambda *args, **kwargs: ["FABRIC_1.9", "FABRIC_1.10"])
    check = doctor.check_fabric_libs(NeuronPlatform(root), "LIBFABRIC")
    assert check.status == "fail" and "FABRIC_1.10 (libfabric >= 2.7.0" in check.fix and "nixl==1.5.0" in check.fix
    monkeypatch.setattr(fabric_libs, "abi_lacking", lambda *args, **kwargs: [])
    assert doctor.check_fabric_libs(NeuronPlatform(root), "LIBFABRIC").fix == "sudo neuron-disagg install-fabric-libs"


def _clean_env() -> dict:
    import os
    return {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}


@pytest.fixture
def lib_dirs(tmp_path, monkeypatch):
    """Point both places serve looks at empty temporary directories."""
    system, user = tmp_path / "opt", tmp_path / "cache"
    monkeypatch.setattr(fabric_libs, "SYSTEM_DIR", system)
    monkeypatch.setenv("NEURON_DISAGG_CACHE", str(user))
    return system, user / "fabric-libs"


def _neuron_config():
    return Config(platform="neuron", backend="LIBFABRIC")


def test_serve_on_neuron_puts_the_libraries_on_vllms_library_path(host, lib_dirs, monkeypatch):
    root, _ = host("trn2")
    monkeypatch.setattr(fabric_libs, "loads", lambda directory, python=sys.executable: "nixlNotFoundError")
    with pytest.raises(ConfigError, match="install-fabric-libs"):
        serve.library_env(_neuron_config(), {}, root)
    system, _ = lib_dirs
    system.mkdir(parents=True)
    (system / fabric_libs.STAMP).touch()
    env = serve.library_env(_neuron_config(), {"LD_LIBRARY_PATH": "/opt/aws/neuron/lib", "HOME": "/h"}, root)
    assert env["LD_LIBRARY_PATH"].startswith(f"{system}:/opt/aws/neuron/lib") and env["HOME"] == "/h"


def test_serve_leaves_the_environment_alone_where_nothing_is_needed(host, lib_dirs, monkeypatch):
    root, _ = host("trn2")
    env = {"LD_LIBRARY_PATH": "/x"}
    monkeypatch.setattr(fabric_libs, "loads", lambda directory, python=sys.executable: "loaded")
    assert serve.library_env(_neuron_config(), env, root) == env  # e.g. the libraries already on the path
    monkeypatch.setattr(fabric_libs, "loads", lambda directory, python=sys.executable: "nixlNotFoundError")
    assert serve.library_env(Config(platform="neuron", backend="UCX"), env, root) == env
    assert serve.library_env(Config(platform="cpu"), env, root) == env


def test_doctor_fails_on_a_neuron_host_until_the_backend_loads(host, lib_dirs, monkeypatch):
    from neuron_disagg.doctor import check_fabric_libs
    from neuron_disagg.platforms.neuron import NeuronPlatform

    root, _ = host("trn2")
    monkeypatch.setattr(fabric_libs, "loads", lambda directory, python=sys.executable: "nixlNotFoundError")
    monkeypatch.setattr(fabric_libs, "plugin", lambda python=None: "libplugin_LIBFABRIC.so")
    monkeypatch.setattr(fabric_libs, "abi_lacking", lambda *args, **kwargs: [])  # the libfabric is new enough
    before = check_fabric_libs(NeuronPlatform(root), "LIBFABRIC")
    assert (before.status, before.fix) == ("fail", "sudo neuron-disagg install-fabric-libs")
    monkeypatch.setattr(fabric_libs, "loads", lambda directory, python=sys.executable: "loaded")
    assert check_fabric_libs(NeuronPlatform(root), "LIBFABRIC").status == "ok"
    assert check_fabric_libs(NeuronPlatform(root), "UCX").status == "ok"


@pytest.mark.integration  # doctor loads NIXL's backend in a child process
def test_doctor_image_for_neuron_fails_where_libfabric_does_not_load(tmp_path, monkeypatch, capsys):
    """The AMI bake runs `doctor --image --platform neuron` on a builder without Neuron devices."""
    from neuron_disagg import doctor

    monkeypatch.setattr(fabric_libs, "loads", lambda directory, python=sys.executable: "nixlNotFoundError")
    rc = doctor.main(["--json", "--image", "--platform", "neuron"])
    out = json.loads(capsys.readouterr().out)
    assert rc != 0 and out["platform"] == "neuron" and out["nixl_backend"] == "LIBFABRIC"
    failed = {c["name"] for c in out["checks"] if c["status"] == "fail"}
    assert "fabric libraries" in failed
