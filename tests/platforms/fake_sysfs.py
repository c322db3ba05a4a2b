"""Build a fake host filesystem (sysfs + /dev) from a compact JSON description of a real instance.

Symlinks are relative, as the kernel makes them, so resolving them stays inside the fake root.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _pci_dir(root: Path, dev: dict, pci_class: str) -> Path:
    d = root / "sys/devices" / dev["pci"]
    d.mkdir(parents=True, exist_ok=True)
    (d / "vendor").write_text(dev["vendor"] + "\n")
    (d / "device").write_text(dev["device"] + "\n")
    (d / "numa_node").write_text(f"{dev['numa']}\n")
    (d / "class").write_text(pci_class + "\n")
    return d


def _class_entry(root: Path, class_path: str, name: str, target: Path) -> None:
    entry = root / class_path / name
    entry.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, entry), entry / "device")


def build(root: Path, desc: dict | str) -> dict:
    desc = load(desc) if isinstance(desc, str) else desc
    (root / "dev").mkdir(parents=True, exist_ok=True)
    (root / "sys/class").mkdir(parents=True, exist_ok=True)
    for dev in desc["neuron"]:
        _class_entry(root, "sys/class/neuron_device", dev["name"], _pci_dir(root, dev, "0x120000"))
    for dev in desc["efa"]:
        _class_entry(root, "sys/class/infiniband", dev["name"], _pci_dir(root, dev, "0x020000"))
    for node in desc["dev_nodes"]:
        (root / "dev" / node).touch()
    for dev in desc.get("gpus", []):
        d = _pci_dir(root, dev, "0x030200")
        link = root / "sys/bus/pci/devices" / dev["pci"].rsplit("/", 1)[-1]
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(d, link.parent), link)
    return desc
