"""PCI topology read from sysfs, to pair each accelerator with the EFA device nearest to it.

Traffic from an accelerator to a NIC behind the same PCIe switch never crosses the CPU's root
complex; one that crosses sockets also crosses the inter-socket link and halves bandwidth. Sysfs
shows this as the device's resolved path (``/sys/devices/pci0000:00/0000:00:01.0/0000:10:00.0``):
the longer the shared prefix, the closer two devices are. ``root`` lets tests point at fake trees.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

EFA_VENDOR = "0x1d0f"
EFA_DEVICE_IDS = frozenset({"0xefa0", "0xefa1", "0xefa2", "0xefa3"})


@dataclass(frozen=True)
class PciDevice:
    """One device as sysfs shows it: its class name (``neuron3``, ``rdmap16s27``) and PCI position."""

    name: str
    path: tuple[str, ...]  # components under /sys/devices, e.g. ("pci0000:00", "0000:00:01.0", ...)
    vendor: str
    device: str
    numa_node: int

    @property
    def bdf(self) -> str:
        return self.path[-1] if self.path else ""


def read_attr(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def under(root: str, path: str) -> str:
    """``path`` (absolute, as on a real host) inside ``root``."""
    return os.path.join(root, path.lstrip("/"))


def read_device(root: str, name: str, device_link: str) -> PciDevice | None:
    """The PCI device behind a sysfs ``device`` symlink, or None if the link is broken."""
    real = os.path.realpath(device_link)
    devices_dir = os.path.realpath(under(root, "/sys/devices"))
    if not os.path.isdir(real):
        return None
    rel = os.path.relpath(real, devices_dir)
    path = tuple(p for p in rel.split(os.sep) if p and p != "..") if not rel.startswith("..") else (real,)
    try:
        numa = int(read_attr(os.path.join(real, "numa_node"), "-1"))
    except ValueError:
        numa = -1
    return PciDevice(name=name, path=path, vendor=read_attr(os.path.join(real, "vendor")).lower(),
                     device=read_attr(os.path.join(real, "device")).lower(), numa_node=numa)


def class_devices(root: str, class_glob: str) -> list[PciDevice]:
    """Devices of a sysfs class (``/sys/class/infiniband/rdmap*``) sorted by PCI address."""
    found = []
    for entry in glob.glob(under(root, class_glob)):
        dev = read_device(root, os.path.basename(entry), os.path.join(entry, "device"))
        if dev is not None:
            found.append(dev)
    return sorted(found, key=lambda d: (d.bdf, d.name))


def efa_devices(root: str = "/") -> list[PciDevice]:
    """EFA NICs: RDMA devices named ``rdmap*`` with Amazon's vendor id and an EFA device id."""
    return [d for d in class_devices(root, "/sys/class/infiniband/rdmap*")
            if d.vendor == EFA_VENDOR and d.device in EFA_DEVICE_IDS]


def _shared_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def nearest(accelerator: PciDevice, nics: list[PciDevice]) -> PciDevice | None:
    """The NIC sharing the longest PCI path with ``accelerator``; ties go to the same NUMA node."""
    if not nics:
        return None
    return max(nics, key=lambda n: (_shared_prefix(accelerator.path, n.path),
                                    n.numa_node == accelerator.numa_node and n.numa_node >= 0,
                                    # stable, deterministic tie-break: lowest PCI address wins
                                    tuple(-ord(c) for c in n.bdf)))


def affinity(accelerators: list[PciDevice], nics: list[PciDevice]) -> dict[str, str | None]:
    """Accelerator name -> nearest NIC name (None when the host has no NIC of that kind)."""
    return {a.name: (n.name if (n := nearest(a, nics)) else None) for a in accelerators}
