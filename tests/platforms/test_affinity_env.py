"""Nearest-EFA mapping from PCI topology, and the fabric environment each platform needs."""

from __future__ import annotations

import pytest

from neuron_disagg.platforms import pci, select_platform
from neuron_disagg.platforms.cpu import CpuPlatform


@pytest.mark.parametrize("name", ["trn2", "trn1"])
def test_each_chip_gets_the_efa_behind_its_pcie_switch(host, name):
    root, desc = host(name)
    platform, _ = select_platform("auto", root=root)
    assert platform.efa_affinity() == desc["expected_affinity"]


def test_trn1_two_chips_share_one_efa(host):
    root, desc = host("trn1")
    platform, _ = select_platform("auto", root=root)
    used = list(platform.efa_affinity().values())
    assert len(set(used)) == 8 and all(used.count(n) == 2 for n in set(used))


def test_numa_breaks_ties_when_no_switch_is_shared():
    acc = pci.PciDevice("neuron0", ("pci0000:00", "0000:00:01.0", "0000:10:00.0"), "0x1d0f", "0x7364", 1)
    far = pci.PciDevice("rdmap1", ("pci0000:40", "0000:40:01.0", "0000:41:00.0"), "0x1d0f", "0xefa1", 0)
    near = pci.PciDevice("rdmap2", ("pci0000:80", "0000:80:01.0", "0000:81:00.0"), "0x1d0f", "0xefa1", 1)
    assert pci.nearest(acc, [far, near]).name == "rdmap2"
    assert pci.nearest(acc, []) is None


def test_non_efa_rdma_devices_are_ignored(tmp_path):
    from . import fake_sysfs
    desc = fake_sysfs.load("trn2")
    desc["efa"][0] = dict(desc["efa"][0], vendor="0x15b3", device="0x101b")  # a Mellanox NIC
    fake_sysfs.build(tmp_path, desc)
    platform, _ = select_platform("auto", root=str(tmp_path))
    assert len(platform.efa_devices()) == 15


def test_cpu_has_no_accelerators_to_pair(host):
    root, _ = host("trn2")
    assert CpuPlatform(root).efa_affinity() == {}


def test_doctor_shows_each_accelerators_nearest_efa(host):
    from neuron_disagg.doctor import check_efa
    root, desc = host("trn2")
    platform, _ = select_platform("auto", root=root)
    check = check_efa(platform)
    assert check.status == "ok" and f"neuron0→{desc['expected_affinity']['neuron0']}" in check.message


def test_trn_fabric_env(host):
    root, _ = host("trn2")
    platform, _ = select_platform("auto", root=root)
    assert platform.fabric_env() == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
                                     "FI_EFA_FORK_SAFE": "1", "FI_EFA_ENABLE_SHM_TRANSFER": "0"}
    assert platform.fabric_env("UCX") == {}
    missing = platform.missing_fabric_env({"FI_PROVIDER": "efa", "FI_EFA_ENABLE_SHM_TRANSFER": "1"})
    assert missing == {"FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1", "FI_EFA_ENABLE_SHM_TRANSFER": "0"}


def test_p5en_fabric_env(host):
    from cuda_compat import CudaPlatform
    root, _ = host("trn2")  # any tree with EFAs
    assert CudaPlatform(root).fabric_env() == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}


def test_cpu_needs_no_fabric_env(host):
    root, _ = host("none")
    platform, _ = select_platform("auto", root=root)
    assert platform.fabric_env() == {} and platform.missing_fabric_env({}) == {}
