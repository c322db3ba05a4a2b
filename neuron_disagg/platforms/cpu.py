"""CPU hosts (development, CI, the local demo): KV in host DRAM, UCX unless EFA is present."""

from __future__ import annotations

from .base import Platform
from .fence import KVFence, ReadyFence


class CpuPlatform(Platform):
    name = "cpu"
    memory_type = "DRAM"
    wait_strategy = "none: the CPU forward pass is synchronous"
    fabric_env_vars: dict[str, str] = {}

    def wait_for_kv(self, stream: object | None = None) -> KVFence:
        return ReadyFence()
