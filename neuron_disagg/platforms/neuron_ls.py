"""Parse ``neuron-ls -j``: the Neuron tool's own view of devices, used by ``doctor`` and to cross-check sysfs.

Older releases print a bare list of devices; newer ones wrap it in an object. Both are accepted;
anything else raises ``ValueError`` naming what was expected.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class NeuronLsDevice:
    index: int
    bdf: str  # "10:00.0" as neuron-ls prints it (no PCI domain)
    nc_count: int
    memory_bytes: int
    connected_to: tuple[int, ...] = ()


def parse_neuron_ls(text: str) -> list[NeuronLsDevice]:
    data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("neuron_devices", data.get("devices"))
    if not isinstance(data, list):
        raise ValueError("neuron-ls -j output is neither a list of devices nor an object with 'neuron_devices'")
    devices = []
    for entry in data:
        devices.append(NeuronLsDevice(
            index=int(entry["neuron_device"]), bdf=str(entry.get("bdf", "")),
            nc_count=int(entry.get("nc_count", 0)), memory_bytes=int(entry.get("memory_size", 0)),
            connected_to=tuple(int(c) for c in entry.get("connected_to") or ())))
    return sorted(devices, key=lambda d: d.index)


def run_neuron_ls(timeout_s: float = 20.0) -> list[NeuronLsDevice] | None:
    """Devices from ``neuron-ls -j``; None when the tool is not installed."""
    exe = shutil.which("neuron-ls")
    if exe is None:
        return None
    out = subprocess.run([exe, "-j"], capture_output=True, text=True, timeout=timeout_s, check=True)
    return parse_neuron_ls(out.stdout)
