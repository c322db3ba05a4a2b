"""AWS Trainium (trn1, trn2, trn3): KV in device memory (NIXL VRAM), moved by LIBFABRIC over EFA.

Neuron work is asynchronous: a step's KV is in HBM only once the device has run what was queued.
The vLLM Neuron plugin (SDK 2.31+) keeps paged KV on the native ``neuron`` torch device by default;
an XLA route (torch_xla) can still be chosen. The fence follows the device the KV tensors are on:
- ``neuron``: an event recorded on the device's current stream where TorchNeuron has events, else
  ``torch.neuron.synchronize()`` run by the waiting thread;
- ``xla``: ``mark_step`` flushes the pending graph on the engine thread, ``wait_device_ops`` waits;
- ``cpu`` (the plugin's CPU mode): nothing to wait for.
The engine thread only records; transfer threads wait, so the forward loop never blocks on the device.
"""

from __future__ import annotations

import glob
import re

from . import pci
from .base import Platform
from .errors import PlatformError
from .fence import CallbackFence, EventFence, KVFence, ReadyFence

NEURON_VENDOR = "0x1d0f"
#: PCI device id -> generation, as NIXL's topology code knows them
#: (ai-dynamo/nixl src/utils/libfabric/libfabric_topology.cpp, isNeuronAccel).
NEURON_DEVICE_IDS = {"0x7164": "trn1", "0x7264": "inf2", "0x7364": "trn2", "0x7564": "trn3", "0x7565": "trn3"}

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
    wait_strategy = ("the KV device's queue: an event on the neuron device's stream (or "
                     "torch.neuron.synchronize), or XLA's mark_step + wait_device_ops on the XLA route")
    fabric_env_vars = NEURON_FABRIC_ENV
    device_registration_may_fail = True
    stream_modes = ("off", "chunks")  # the compiled graph runs every layer in one call: no per-layer hook

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

    def use_kv_device(self, device: object) -> None:
        """NIXL's LIBFABRIC plugin creates its Neuron memory path only if the Neuron runtime is up
        when the first agent starts (NIXL's own benchmark: nixlbench nixl_worker.cpp). The plugin's
        worker starts it before allocating KV; here its queue is drained once, which needs it."""
        super().use_kv_device(device)
        route = _route(device)
        if route == "neuron":
            _torch_neuron().synchronize()
        elif route == "xla":
            import torch_xla.core.xla_model as xm

            xm.wait_device_ops()

    def wait_for_kv(self, stream: object | None = None) -> KVFence:
        route = _route(self.kv_device)
        if route == "neuron":
            neuron = _torch_neuron()
            if hasattr(neuron, "Event") and hasattr(neuron, "current_stream"):
                event = neuron.Event()
                event.record(stream if stream is not None else neuron.current_stream(self.kv_device))
                return EventFence(event)
            return CallbackFence(neuron.synchronize)
        if route == "xla":
            import torch_xla.core.xla_model as xm  # lazily: absent on every non-Neuron host

            xm.mark_step()
            return CallbackFence(xm.wait_device_ops)
        return ReadyFence()  # the plugin's CPU mode: synchronous


def _route(device: object | None) -> str:
    """"neuron", "xla" or "cpu": where the KV tensors live (vLLM Neuron plugin routes)."""
    kind = getattr(device, "type", None)
    if kind in ("neuron", "xla", "cpu"):
        return kind
    raise PlatformError(f"neuron-disagg on a Neuron host found the KV cache on device {device!r}; the vLLM "
                        "Neuron plugin keeps it on the neuron device (or xla on the XLA route)")


def _torch_neuron():
    import torch

    neuron = getattr(torch, "neuron", None)
    if neuron is None or not hasattr(neuron, "synchronize"):
        raise PlatformError("the KV cache is on the neuron device but torch.neuron.synchronize is missing: "
                            "run inside the Neuron DLAMI's vLLM environment (TorchNeuron)")
    return neuron

