"""The GPU (p5en) image's fabric libraries, without starting a process: NIXL 1.4.1's LIBFABRIC plugin
needs libcudart and hwloc's library besides libfabric and libcuda, and the GPU DLAMI's NVIDIA
driver provides only libcuda. ``install-fabric-libs --platform cuda`` provides the other two and
never a libcuda stub (one first on the units' library path would hide the driver); ``doctor`` on
the CUDA platform names what the plugin cannot find, where the units look, and the fix.

The same against the real linker, in a namespace that hides this machine's CUDA toolkit:
tests/deploy/test_ami.py (the fabric-libs step for a GPU image)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuda_compat import CudaPlatform
from neuron_disagg import doctor
from neuron_disagg.platforms import fabric_libs, libcuda_stub
from neuron_disagg.platforms.neuron import NeuronPlatform

PLUGIN = Path("/venv/nixl_cu12.libs/nixl/libplugin_LIBFABRIC.so")


class Planned:
    """fabric_libs with the linker, downloads and the backend probe replaced: what ``install`` asks
    for, given what ``ldd`` says is missing before and after."""

    def __init__(self, monkeypatch, before: list[str], after: list[str] | None = None):
        self.calls: list[tuple] = []
        answers = [before, after or []]
        monkeypatch.setattr(fabric_libs, "plugin", lambda python=None: PLUGIN)
        monkeypatch.setattr(fabric_libs, "missing",
                            lambda plugin, directory=None, search_path=None: answers.pop(0) if answers else [])
        monkeypatch.setattr(fabric_libs, "loads", lambda directory, python=None: "loaded")
        monkeypatch.setattr(fabric_libs, "abi_lacking", lambda *args, **kwargs: [])  # a new enough libfabric

        def cudart(directory, major, python):
            self.calls.append(("cudart", major))
            (directory / f"libcudart.so.{major}").write_bytes(b"runtime")

        def hwloc(directory):
            self.calls.append(("hwloc",))
            (directory / "libhwloc.so.15").write_bytes(b"hwloc")

        def stub(directory, *args, **kwargs):
            self.calls.append(("stub",))
            (directory / "libcuda.so.1").write_bytes(b"stub")

        monkeypatch.setattr(fabric_libs, "_cuda_runtime", cudart)
        monkeypatch.setattr(fabric_libs, "_hwloc", hwloc)
        monkeypatch.setattr(libcuda_stub, "build", stub)


def test_install_for_cuda_provides_the_runtime_and_hwloc_and_no_libcuda_stub(tmp_path, monkeypatch):
    plan = Planned(monkeypatch, before=["libcudart.so.12", "libhwloc.so.15"])
    provided = fabric_libs.install(tmp_path, platform="cuda")
    assert provided == ["libcudart.so.12", "libhwloc.so.15"]
    assert plan.calls == [("cudart", "12"), ("hwloc",)]
    assert not (tmp_path / "libcuda.so.1").exists() and (tmp_path / fabric_libs.STAMP).exists()


def test_install_for_cuda_removes_a_stub_an_earlier_run_left(tmp_path, monkeypatch):
    """A directory first set up for Neuron (or by the old cuda-less command) holds our stub: on a
    GPU host it would shadow the driver's libcuda for every unit, so it goes, and is not rebuilt."""
    (tmp_path / "libcuda.so.1").write_bytes(b"stub")
    (tmp_path / ".built-from-0123456789abcdef").touch()
    plan = Planned(monkeypatch, before=["libhwloc.so.15"])
    assert fabric_libs.install(tmp_path, platform="cuda") == ["libhwloc.so.15"]
    assert ("stub",) not in plan.calls
    assert not (tmp_path / "libcuda.so.1").exists() and not list(tmp_path.glob(".built-from-*"))


def test_install_for_cuda_refuses_to_stand_in_for_a_missing_driver(tmp_path, monkeypatch):
    plan = Planned(monkeypatch, before=["libcuda.so.1", "libcudart.so.13", "libhwloc.so.15"])
    with pytest.raises(fabric_libs.FabricLibsError, match="NVIDIA driver"):
        fabric_libs.install(tmp_path, platform="cuda")
    assert ("stub",) not in plan.calls and not (tmp_path / "libcuda.so.1").exists()
    assert not (tmp_path / fabric_libs.STAMP).exists()


def test_install_for_neuron_still_provides_all_three(tmp_path, monkeypatch):
    plan = Planned(monkeypatch, before=["libcuda.so.1", "libcudart.so.13", "libhwloc.so.15"])
    assert fabric_libs.install(tmp_path) == ["libcuda.so.1", "libcudart.so.13", "libhwloc.so.15"]
    assert plan.calls == [("stub",), ("cudart", "13"), ("hwloc",)]


def test_install_refuses_an_unknown_platform(tmp_path):
    with pytest.raises(fabric_libs.FabricLibsError, match="neuron, cuda"):
        fabric_libs.install(tmp_path, platform="rocm")


def test_the_runtime_the_environment_already_has_is_linked_not_downloaded(tmp_path, monkeypatch):
    """torch's CUDA build brings NVIDIA's runtime wheel: the plugin gets that very library (one
    runtime per process), with nothing downloaded."""
    site = tmp_path / "site-packages"
    runtime = site / "nvidia/cuda_runtime/lib/libcudart.so.12"
    runtime.parent.mkdir(parents=True)
    runtime.write_bytes(b"runtime")
    assert fabric_libs.cudart_in([tmp_path / "elsewhere", site], "12") == runtime
    assert fabric_libs.cudart_in([site], "13") is None
    monkeypatch.setattr(fabric_libs, "_sites", lambda python: [site])
    target = tmp_path / "lib"
    target.mkdir()
    fabric_libs._cuda_runtime(target, "12", "python")  # a download would start a process: refused here
    assert (target / "libcudart.so.12").is_symlink() and (target / "libcudart.so.12").resolve() == runtime


def test_the_command_passes_the_platform(tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(fabric_libs, "install", lambda directory, platform="neuron": seen.setdefault(platform, []))
    assert fabric_libs.main(["--dir", str(tmp_path), "--platform", "cuda"]) == 0
    assert fabric_libs.main(["--dir", str(tmp_path)]) == 0
    assert set(seen) == {"cuda", "neuron"}
    assert "/opt/neuron-disagg/lib" in capsys.readouterr().out  # where the units look, said for cuda


# -- doctor on the CUDA platform --------------------------------------------------------------------
def fake_linker(monkeypatch, lacking: list[str], state: str = "nixlNotFoundError: LIBFABRIC",
                found: Path | None = None) -> list:
    """What doctor asks the linker and the probe, answered; returns the search paths it asked with."""
    asked = []

    def missing(plugin, directory=None, search_path=None):
        asked.append(search_path)
        return list(lacking)

    monkeypatch.setattr(fabric_libs, "find", lambda: found)
    monkeypatch.setattr(fabric_libs, "loads", lambda directory, python=None: state)
    monkeypatch.setattr(fabric_libs, "plugin", lambda python=None: PLUGIN)
    monkeypatch.setattr(fabric_libs, "missing", missing)
    monkeypatch.setattr(fabric_libs, "abi_lacking", lambda *args, **kwargs: [])  # a new enough libfabric
    return asked


def test_doctor_cuda_names_the_missing_runtime_and_hwloc_and_the_fix(tmp_path, monkeypatch):
    fake_linker(monkeypatch, ["libcudart.so.12", "libhwloc.so.15"])
    check = doctor.check_fabric_libs(CudaPlatform(str(tmp_path)), "LIBFABRIC")
    assert check.status == "fail"
    assert "libcudart.so.12" in check.message and "libhwloc.so.15" in check.message
    assert "neuron-disagg install-fabric-libs --platform cuda" in check.fix
    assert "NVIDIA driver" not in check.fix  # the driver is there: not what to fix


def test_doctor_cuda_says_the_driver_provides_libcuda(tmp_path, monkeypatch):
    fake_linker(monkeypatch, ["libcuda.so.1"])
    check = doctor.check_fabric_libs(CudaPlatform(str(tmp_path)), "LIBFABRIC")
    assert check.status == "fail" and "libcuda.so.1" in check.message
    assert "NVIDIA driver" in check.fix and "install-fabric-libs" not in check.fix


def test_doctor_checks_with_the_units_library_path_not_its_own(tmp_path, monkeypatch):
    """The backend loads in this shell (its LD_LIBRARY_PATH has a CUDA toolkit, say), but the units
    run with fabric.env's: with that the plugin lacks libcudart and hwloc, so serving would fail."""
    env = tmp_path / "etc/neuron-disagg/fabric.env"
    env.parent.mkdir(parents=True)
    env.write_text("# as an AMI built before the GPU image had the fabric libraries\nFI_PROVIDER=efa\n"
                   "LD_LIBRARY_PATH=/opt/amazon/efa/lib\nHF_HOME=/opt/neuron-disagg/hf\n")
    asked = fake_linker(monkeypatch, ["libcudart.so.13", "libhwloc.so.15"], state="loaded")
    check = doctor.check_fabric_libs(CudaPlatform(str(tmp_path)), "LIBFABRIC")
    assert asked == ["/opt/amazon/efa/lib"]
    assert check.status == "fail" and "units' LD_LIBRARY_PATH" in check.message and str(env) in check.message
    assert "libcudart.so.13, libhwloc.so.15" in check.message
    assert "install-fabric-libs --platform cuda" in check.fix
    assert "put /opt/neuron-disagg/lib first on LD_LIBRARY_PATH" in check.fix


def test_doctor_cuda_passes_when_the_units_path_resolves_everything(tmp_path, monkeypatch):
    env = tmp_path / "etc/neuron-disagg/fabric.env"
    env.parent.mkdir(parents=True)
    env.write_text("LD_LIBRARY_PATH=/opt/neuron-disagg/lib:/opt/amazon/efa/lib\n")
    found = tmp_path / "lib"
    found.mkdir()
    asked = fake_linker(monkeypatch, [], state="loaded", found=found)
    check = doctor.check_fabric_libs(CudaPlatform(str(tmp_path)), "LIBFABRIC")
    assert check.status == "ok" and asked == ["/opt/neuron-disagg/lib:/opt/amazon/efa/lib"], check


def test_doctor_cuda_fails_on_a_libcuda_stub_in_the_units_directory(tmp_path, monkeypatch):
    found = tmp_path / "lib"
    found.mkdir()
    (found / "libcuda.so.1").write_bytes(b"stub")
    fake_linker(monkeypatch, [], state="loaded", found=found)
    check = doctor.check_fabric_libs(CudaPlatform(str(tmp_path)), "LIBFABRIC")
    assert check.status == "fail" and "hides the NVIDIA driver" in check.message
    assert "--platform cuda" in check.fix


def test_doctor_neuron_fix_is_unchanged(tmp_path, monkeypatch):
    asked = fake_linker(monkeypatch, ["libcudart.so.13"])
    check = doctor.check_fabric_libs(NeuronPlatform(str(tmp_path)), "LIBFABRIC")
    assert (check.status, check.fix) == ("fail", "sudo neuron-disagg install-fabric-libs")
    assert asked == []  # no fabric.env here, and on Neuron the one fix needs no linker run


def test_doctor_neuron_also_checks_the_units_library_path(tmp_path, monkeypatch):
    env = tmp_path / "etc/neuron-disagg/fabric.env"
    env.parent.mkdir(parents=True)
    env.write_text("LD_LIBRARY_PATH=/opt/amazon/efa/lib\n")
    asked = fake_linker(monkeypatch, ["libcuda.so.1", "libcudart.so.13", "libhwloc.so.15"], state="loaded")
    check = doctor.check_fabric_libs(NeuronPlatform(str(tmp_path)), "LIBFABRIC")
    assert asked == ["/opt/amazon/efa/lib"] and check.status == "fail"
    assert "libcuda.so.1, libcudart.so.13, libhwloc.so.15" in check.message
    assert check.fix == "sudo neuron-disagg install-fabric-libs"
