"""KV memory in plain host buffers, addressed like device memory: for the demo and fast tests.

Each agent owns one ``bytearray``; an address is an offset into it. ``execute`` performs a
``WritePlan`` the way a NIXL WRITE would: byte ranges from the source agent's memory into the
destination agent's, each range checked to lie inside both buffers.
"""

from __future__ import annotations

from ..protocol.plan import WritePlan


class MemoryFabric:
    def __init__(self) -> None:
        self.memory: dict[str, bytearray] = {}

    def register(self, agent: str, size_bytes: int) -> bytearray:
        self.memory[agent] = bytearray(size_bytes)
        return self.memory[agent]

    def execute(self, src_agent: str, plan: WritePlan) -> int:
        """Copy every descriptor of the plan; returns bytes moved."""
        src = memoryview(self.memory[src_agent])
        moved = 0
        for write in plan.writes:
            dst = memoryview(self.memory[write.remote_agent])
            for s, d, n in zip(write.src_addr.tolist(), write.dst_addr.tolist(), write.length.tolist(), strict=True):
                if s + n > len(src) or d + n > len(dst):
                    raise ValueError(f"descriptor {s:#x}->{d:#x} ({n} bytes) leaves registered memory")
                dst[d:d + n] = src[s:s + n]
                moved += n
        return moved
