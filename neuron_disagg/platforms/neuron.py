"""AWS Trainium (trn1, trn2): KV in device memory (NIXL VRAM), moved by LIBFABRIC over EFA.

Neuron work is asynchronous: a step's KV is only known to be in HBM after XLA has flushed the
pending graph (``mark_step``) and the device has drained its queue (``wait_device_ops``). The engine
thread flushes; the writer thread waits, so the forward loop never blocks on the device.
"""

from __future__ import annotations

import glob
import re

from . import pci
from .base import Platform
from .fence import CallbackFence, KVFence, ReadyFence

NEURON_VENDOR = "0x1d0f"
#: PCI device id -> generation (notes/neuron-efa-aws.md).
NEURON_DEVICE_IDS = {"0x7164": "trn1", "0x7364": "trn2", "0x7565": "trn3", "0x7566": "trn3"}

#: FI_EFA_ENABLE_SHM_TRANSFER=0: without it single-node disaggregation can give wrong output.
NEURON_FABRIC_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
                     "FI_EFA_ENABLE_SHM_TRANSFER": "0"}


def neuron_device_nodes(root: str = "/") -> list[str]:
    """What proves a Neuron driver is loaded: /dev/neuron* nodes and /sys/class/neuron_device entries."""
    return sorted(glob.glob(pci.under(root, "/dev/neuron*"))
                  + glob.glob(pci.under(root, "/sys/class/neuron_device/*")))


def _index(name: str) -> int:
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else -1


class NeuronPlatform(Platform):
    name = "neuron"
    memory_type = "VRAM"
    wait_strategy = "XLA sync: mark_step on the engine thread, wait_device_ops on the writer thread"
    fabric_env_vars = NEURON_FABRIC_ENV

    def __init__(self, root: str = "/") -> None:
        super().__init__(root)
        self._accs: list[pci.PciDevice] | None = None

    def accelerators(self) -> list[pci.PciDevice]:
        """Neuron devices in runtime index order (``neuron0``, ``neuron1``, ...), as PCI devices."""
        if self._accs is None:
            devs = [d for d in pci.class_devices(self.root, "/sys/class/neuron_device/neuron*")
                    if d.vendor in ("", NEURON_VENDOR)]
            self._accs = sorted(devs, key=lambda d: _index(d.name))
        return self._accs

    def generation(self) -> str | None:
        """trn1/trn2/trn3 from the PCI device id of the first device (None if sysfs does not say)."""
        for d in self.accelerators():
            if d.device in NEURON_DEVICE_IDS:
                return NEURON_DEVICE_IDS[d.device]
        return None

    def wait_for_kv(self, stream: object | None = None) -> KVFence:
        try:
            import torch_xla.core.xla_model as xm  # lazily: absent on every non-Neuron host
        except ImportError:
            # vllm-neuron builds without torch_xla execute eagerly through the Neuron runtime.
            return ReadyFence()
        xm.mark_step()
        return CallbackFence(xm.wait_device_ops)

