"""CUDA: KV in GPU memory (NIXL VRAM); fenced by a CUDA event the writer thread synchronizes on.

Recording an event on the current stream costs microseconds and never blocks the engine; the writer
thread calls ``synchronize`` on it before the WRITE, so the NIC never reads KV still being computed.
"""

from __future__ import annotations

import glob
import sys

from neuron_disagg.platforms import pci
from neuron_disagg.platforms.base import Platform
from neuron_disagg.platforms.fence import EventFence, KVFence

NVIDIA_VENDOR = "0x10de"
#: p5en: GPUDirect RDMA over EFA. No FORK_SAFE/SHM settings are needed on GPU memory.
CUDA_FABRIC_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}


def _torch_cuda():
    """``torch.cuda``, imported lazily (tests put a stub module in ``sys.modules['torch']``)."""
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # noqa: PLC0415 - deliberately lazy: importing torch costs seconds
    return torch.cuda


class CudaPlatform(Platform):
    name = "cuda"
    memory_type = "VRAM"
    wait_strategy = "CUDA event recorded on the KV device's current stream; the writer thread synchronizes on it"
    fabric_env_vars = CUDA_FABRIC_ENV

    def __init__(self, root: str = "/") -> None:
        super().__init__(root)
        self._accs: list[pci.PciDevice] | None = None

    def accelerators(self) -> list[pci.PciDevice]:
        """NVIDIA 3D/display controllers in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID order)."""
        if self._accs is None:
            gpus = []
            for entry in glob.glob(pci.under(self.root, "/sys/bus/pci/devices/*")):
                dev = pci.read_device(self.root, entry.rsplit("/", 1)[-1], entry)
                cls = pci.read_attr(f"{entry}/class")
                if dev and dev.vendor == NVIDIA_VENDOR and cls.startswith(("0x0302", "0x0300")):
                    gpus.append(dev)
            self._accs = sorted(gpus, key=lambda d: d.bdf)
        return self._accs

    def wait_for_kv(self, stream: object | None = None) -> KVFence:
        """An event on the KV device's current stream (vLLM 0.32 runs the forward on a per-thread
        stream of its own and zeroes new blocks there): not the default device's, not stream 0."""
        cuda = _torch_cuda()
        event = cuda.Event()
        event.record(stream if stream is not None else cuda.current_stream(self.kv_device))
        return EventFence(event)
