"""Platform selection on recorded device trees, and the errors an impossible override gives."""

from __future__ import annotations

import logging

import pytest

from neuron_disagg.platforms import PlatformNotAvailable, UnknownPlatform, select_platform
from neuron_disagg.platforms.neuron_ls import parse_neuron_ls

from .fake_sysfs import FIXTURES


@pytest.mark.parametrize("name,generation,n_efa", [("trn2", "trn2", 16), ("trn1", "trn1", 8)])
def test_neuron_hosts_select_neuron_with_libfabric(host, name, generation, n_efa):
    root, desc = host(name)
    platform, reason = select_platform("auto", root=root)
    assert platform.name == "neuron" and "Neuron devices found" in reason
    assert platform.generation() == generation
    assert len(platform.accelerators()) == 16 and len(platform.efa_devices()) == n_efa
    assert platform.nixl_backend() == "LIBFABRIC"
    assert platform.memory_type == "VRAM"


def test_empty_host_selects_cpu_with_ucx(host):
    root, _ = host("none")
    platform, reason = select_platform("auto", root=root)
    assert platform.name == "cpu" and platform.memory_type == "DRAM"
    assert platform.nixl_backend() == "UCX"
    assert "no Neuron device and no CUDA GPU" in reason


def test_config_backend_overrides_auto(host):
    root, _ = host("trn2")
    platform, _ = select_platform("auto", root=root)
    assert platform.nixl_backend("UCX") == "UCX"


def test_explicit_cpu_wins_on_neuron_host(host):
    root, _ = host("trn2")
    platform, reason = select_platform("cpu", root=root)
    assert platform.name == "cpu" and "config" in reason


def test_neuron_requested_without_devices_names_what_was_looked_for(host):
    root, _ = host("none")
    with pytest.raises(PlatformNotAvailable) as err:
        select_platform("neuron", root=root)
    msg = str(err.value)
    assert "/dev/neuron*" in msg and "/sys/class/neuron_device" in msg and "platform: auto" in msg


def test_cuda_requested_without_gpu_names_what_was_looked_for(host, monkeypatch):
    import sys
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # and no /dev/nvidia0 -> torch not imported
    root, _ = host("none")
    with pytest.raises(PlatformNotAvailable) as err:
        select_platform("cuda", root=root)
    assert "torch.cuda.is_available()" in str(err.value) and "/dev/nvidia" in str(err.value)
    assert "torch" not in sys.modules


def test_unknown_platform():
    with pytest.raises(UnknownPlatform, match="auto, neuron, cuda, cpu"):
        select_platform("tpu")


def test_choice_is_logged_once(host, caplog, monkeypatch):
    from neuron_disagg.platforms import select as select_module
    monkeypatch.setattr(select_module, "_logged", set())
    root, _ = host("trn1")
    with caplog.at_level(logging.INFO, logger="neuron_disagg.platforms.select"):
        select_platform("auto", root=root)
        select_platform("auto", root=root)
    lines = [r for r in caplog.records if "accelerator platform: neuron" in r.getMessage()]
    assert len(lines) == 1


@pytest.mark.parametrize("name", ["trn2", "trn1"])
def test_recorded_neuron_ls_agrees_with_sysfs(host, name):
    root, _ = host(name)
    platform, _ = select_platform("auto", root=root)
    listed = parse_neuron_ls((FIXTURES / f"{name}-neuron-ls.json").read_text())
    assert [d.index for d in listed] == list(range(16))
    # neuron-ls prints bus:dev.fn without the PCI domain
    assert [d.bdf for d in listed] == [a.bdf.split(":", 1)[1] for a in platform.accelerators()]


def test_neuron_ls_wrapped_object_and_garbage():
    assert parse_neuron_ls('{"neuron_devices": [{"neuron_device": 1, "bdf": "10:00.0"}]}')[0].index == 1
    with pytest.raises(ValueError, match="neuron_devices"):
        parse_neuron_ls('{"something": 1}')
