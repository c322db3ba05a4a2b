"""The interface every accelerator platform implements; callers never branch on the accelerator.

The connector and the transfer layer ask a ``Platform`` which NIXL backend and memory type to use,
how to fence a step's KV before writing it, which EFA device is nearest to an accelerator, and which
environment variables the fabric needs. One implementation per accelerator: ``neuron``, ``cpu`` and
the top-level ``cuda_compat`` package (imported only where CUDA exists).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Literal

from . import pci
from .errors import PlatformError
from .fence import KVFence

Backend = Literal["UCX", "LIBFABRIC"]
MemoryType = Literal["VRAM", "DRAM"]

#: UCX's own default, spelled out: ``peer`` detects a dead peer; ``none`` hides it (see notes/nixl.md).


class Platform(ABC):
    name: str
    memory_type: MemoryType
    wait_strategy: str  # one line for logs and `doctor`: how wait_for_kv fences a step
    fabric_env_vars: dict[str, str] = {}  # what the EFA provider needs on this accelerator
    #: Whether NIXL may be unable to register this accelerator's memory (then ``host_staging``
    #: defaults to ``auto``; elsewhere a failed registration stops the start).
    device_registration_may_fail: bool = False
    #: How finely push may stream, coarsest first: ``layers`` needs vLLM's per-layer hook
    #: (``save_kv_layer``), which runs where attention is a Python op between layers.
    stream_modes: tuple[str, ...] = ("off", "chunks", "layers")
    #: What runs unless the config says: ``layers`` puts the writer's work inside the forward, which
    #: on CPU cost the engine thread more than it saved (docs/benchmarks.md); not yet run on a GPU.
    default_stream = "chunks"

    def __init__(self, root: str = "/") -> None:
        self.root = root
        self._efa: list[pci.PciDevice] | None = None
        self.kv_device: object | None = None  # the torch device the KV lives on, once registered

    # -- the KV's device ------------------------------------------------------------------------------
    def use_kv_device(self, device: object) -> None:
        """The connector found its KV tensors on ``device``: fences follow it, and the accelerator's
        runtime is ready for NIXL to register its memory. Called before any NIXL agent exists."""
        self.kv_device = device

    def host_staging(self, configured: str | None) -> str:
        """The ``host_staging`` mode to run: the config's, else this platform's default."""
        return configured or ("auto" if self.device_registration_may_fail else "never")

    def stream_mode(self, configured: str | None, layer_hook_once: bool = True) -> str:
        """The ``stream`` mode to run: the config's, else ``default_stream``. A mode the platform
        cannot run stops the start with what to set instead. ``layer_hook_once``: vLLM calls the
        per-layer hook once per layer and step (not with micro-batching, DBO)."""
        modes = self.stream_modes if layer_hook_once else tuple(m for m in self.stream_modes if m != "layers")
        if configured is None:
            return self.default_stream
        if configured not in modes:
            why = (f"{self.name}'s engine never calls vLLM's per-layer hook" if configured not in self.stream_modes
                   else "with micro-batching (--enable-dbo, --ubatch-size) vLLM calls the per-layer hook once "
                        "per micro-batch, before every micro-batch wrote the layer's KV")
            raise PlatformError(f"stream: {configured} cannot run here: {why}; set stream: {modes[-1]}")
        return configured

    # -- NICs ---------------------------------------------------------------------------------------
    def efa_devices(self) -> list[pci.PciDevice]:
        if self._efa is None:
            self._efa = pci.efa_devices(self.root)
        return self._efa

    def accelerators(self) -> list[pci.PciDevice]:
        """This platform's accelerators as PCI devices, in the runtime's device-index order."""
        return []

    def efa_affinity(self) -> dict[str, str | None]:
        """Accelerator -> the EFA device nearest it by PCI topology. NIXL's LIBFABRIC plugin picks its
        rails by the same topology itself; `doctor` shows this so a user can check the pairing."""
        return pci.affinity(self.accelerators(), self.efa_devices())

    # -- NIXL ---------------------------------------------------------------------------------------
    def nixl_backend(self, configured: str = "auto") -> Backend:
        """LIBFABRIC when EFA devices exist, else UCX; an explicit config choice wins."""
        if configured in ("UCX", "LIBFABRIC"):
            return configured  # type: ignore[return-value]
        return "LIBFABRIC" if self.efa_devices() else "UCX"

    # -- fabric environment -------------------------------------------------------------------------
    def fabric_env(self, backend: str | None = None) -> dict[str, str]:
        """Environment variables the fabric needs; only the EFA (LIBFABRIC) path needs any."""
        backend = backend or self.nixl_backend()
        return dict(self.fabric_env_vars) if backend == "LIBFABRIC" else {}

    def missing_fabric_env(self, env: dict[str, str] | None = None, backend: str | None = None) -> dict[str, str]:
        """Required variables that are unset or set differently in ``env`` -> the value they need."""
        env = os.environ if env is None else env
        return {k: v for k, v in self.fabric_env(backend).items() if env.get(k) != v}

    # -- KV fence -----------------------------------------------------------------------------------
    @abstractmethod
    def wait_for_kv(self, stream: object | None = None) -> KVFence:
        """Record, on the engine thread, a fence for the KV written so far; never blocks there."""

    def describe(self) -> dict[str, object]:
        backend = self.nixl_backend()
        return {"platform": self.name, "nixl_backend": backend, "memory_type": self.memory_type,
                "wait_for_kv": self.wait_strategy, "efa_devices": [d.name for d in self.efa_devices()],
                "fabric_env": self.fabric_env(backend)}
