"""The byte movers under the writer and reader threads, behind one interface.

``NixlTransport`` drives a real NIXL agent (UCX on hosts without EFA, LIBFABRIC where EFA exists).
``InMemoryTransport`` moves bytes between agents in one process with ``memmove`` and exists for
fast tests of the threads. Both take descriptors as produced by ``protocol.plan`` (absolute
addresses inside registered memory) and raise ``TransferFailed`` with a reason a person can act on.

A transfer can be built ahead (``prepare``) and started later (``start``): P's writer builds a
prefill's WRITEs during the forward that computes its KV, so that what follows the forward only
posts them. A prepared transfer belongs to the agent and the load of the peer's metadata it was
built against (its ``epoch``); once either is replaced, ``start`` refuses it and the caller posts
afresh — it would otherwise point at memory keys that are gone.

Threading: a transport is owned by one thread (the writer or reader); only ``add_peer`` /
``remove_peer`` may run on another (the handshake executor), which is why NIXL agents are created
with RW thread sync and why replacing the agent (``reset``) holds a lock those two take as well.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import importlib
import importlib.metadata
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any
from collections.abc import Sequence

import numpy as np

from ..protocol.messages import Region
from ..protocol.plan import RankWrite


class TransferFailed(Exception):
    """A transfer could not be posted or did not complete; nothing of it is in flight any more."""


@dataclass(frozen=True)
class MemorySpan:
    addr: int
    length: int
    device_id: int = 0


@dataclass(frozen=True, eq=False)
class Prepared:
    """A transfer built and not started (``Transport.prepare``)."""

    op: str
    peer: str
    write: RankWrite
    handle: Any
    epoch: tuple[int, int]  # (the agent's generation, the peer's load) it was built against


def region_spans(regions: Sequence[Region]) -> list[MemorySpan]:
    """The memory the regions cover, as few spans as possible: regions of one buffer overlap or
    touch (vLLM 0.29+ keeps every layer in one allocation; K and V planes interleave by block),
    and each byte is registered once."""
    spans: list[MemorySpan] = []
    for r in sorted(regions, key=lambda r: (r.device_id, r.base_addr)):
        end = r.base_addr + r.extent_bytes
        last = spans[-1] if spans else None
        if last is not None and last.device_id == r.device_id and r.base_addr <= last.addr + last.length:
            spans[-1] = MemorySpan(last.addr, max(last.length, end - last.addr), r.device_id)
        else:
            spans.append(MemorySpan(r.base_addr, end - r.base_addr, r.device_id))
    return spans


def spans_cover(spans: Sequence[MemorySpan], addr: np.ndarray, length: np.ndarray) -> bool:
    """True if every [addr, addr+length) lies inside one of ``spans``."""
    if len(addr) == 0:
        return True
    starts = np.array([s.addr for s in spans], dtype=np.uint64)
    ends = starts + np.array([s.length for s in spans], dtype=np.uint64)
    order = np.argsort(starts)
    idx = np.searchsorted(starts[order], addr, side="right") - 1
    if (idx < 0).any():
        return False
    return bool(np.all(addr + length <= ends[order][idx]))


class Transport(abc.ABC):
    name: str
    memory_type: str  # what register() registers: "DRAM" or "VRAM" (NIXL's names)
    #: After a failed transfer, replace the agent (``reset``) before the next post. True where a
    #: failure can leave the agent unusable (NIXL 1.4.1's LIBFABRIC plugin, measured).
    reset_after_failure: bool = False
    _generation = 0                  # bumped by reset: the agent's own
    _loads: dict[str, int] | None = None  # peer -> how many times its metadata was loaded

    def _loaded(self, peer: str) -> None:
        """From ``add_peer``: a new load of ``peer``'s metadata outdates what was prepared for it."""
        if self._loads is None:
            self._loads = {}
        self._loads[peer] = self._loads.get(peer, 0) + 1

    def _epoch(self, peer: str) -> tuple[int, int]:
        return self._generation, (self._loads or {}).get(peer, 0)

    def loaded_backends(self) -> list[str]:
        """The NIXL backends this transport's agent really loaded (none for in-memory)."""
        return []

    @abc.abstractmethod
    def register(self, regions: Sequence[Region]) -> None:
        """Make these local KV regions reachable by peers."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer passes to ``add_peer`` to reach this transport."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (replacing any older copy); returns the peer's name."""

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer, e.g. after it died: a restarted peer is re-added with fresh metadata."""

    @abc.abstractmethod
    def has_peer(self, name: str) -> bool: ...

    def post(self, op: str, peer: str, write: RankWrite, notification: bytes) -> Any:
        """Start a WRITE (local src -> peer dst) or READ (peer src -> local dst); the peer gets
        ``notification`` once the data has landed. Returns a handle for ``poll``."""
        # Just built, so no epoch to check: a load racing the build fails it in NIXL, as it always did.
        return self._start(self.prepare(op, peer, write, notification), b"")

    @abc.abstractmethod
    def prepare(self, op: str, peer: str, write: RankWrite, notification: bytes = b"") -> Prepared:
        """Build the transfer ``post`` would start, without starting it; ``start`` it or ``discard``
        it. The notification may come with either (``start``'s replaces this one). Raises
        TransferFailed."""

    def start(self, prepared: Prepared, notification: bytes) -> Any | None:
        """Post a prepared transfer, as ``post`` does; None, having discarded it, if the agent or the
        peer's metadata it was built against has been replaced since (post afresh then)."""
        if prepared.epoch != self._epoch(prepared.peer) or not self.has_peer(prepared.peer):
            self.discard(prepared)
            return None
        return self._start(prepared, notification)

    @abc.abstractmethod
    def _start(self, prepared: Prepared, notification: bytes) -> Any: ...

    @abc.abstractmethod
    def discard(self, prepared: Prepared) -> None:
        """Drop a prepared transfer that will not be started."""

    @abc.abstractmethod
    def poll(self, handle: Any) -> bool:
        """True once the transfer completed; raises TransferFailed if it failed."""

    @abc.abstractmethod
    def release(self, handle: Any) -> None:
        """Drop the handle; an active transfer is cancelled."""

    @abc.abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (sender, payload)."""

    def reset(self) -> None:
        """Replace the agent by a fresh one with a new ``name`` and the same registered memory; every
        peer is forgotten. Call only with nothing in flight."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset its agent")

    def close(self) -> None:  # noqa: B027  (an optional hook, not abstract: a transport holding nothing keeps this no-op)
        pass


# -- in memory ------------------------------------------------------------------------------------------
class InMemoryTransport(Transport):
    """Agents in one process; addresses are real process addresses (e.g. numpy buffers)."""

    _agents: dict[str, InMemoryTransport] = {}
    _lock = threading.Lock()

    def __init__(self, name: str, backend: str = "memory", memory_type: str = "DRAM"):
        self.name, self.memory_type = name, memory_type  # the signature NixlTransport has
        self.spans: list[MemorySpan] = []
        self._peers: set[str] = set()
        self._inbox: list[tuple[str, bytes]] = []
        self._inbox_lock = threading.Lock()
        self.fail_posts_to: set[str] = set()  # fault injection for tests
        # Tests: transfers to these peers stay in progress until ``land_stalled``, and releasing
        # one does not stop it — as with an RDMA operation in flight.
        self.stall_posts_to: set[str] = set()
        self._stalled: list[tuple[RankWrite, InMemoryTransport, bytes, list[bool]]] = []
        self.prepared_live: set[Prepared] = set()  # built, neither started nor discarded: for tests
        with self._lock:
            self._agents[name] = self

    def register(self, regions: Sequence[Region]) -> None:
        self.spans.extend(region_spans(regions))

    def metadata(self) -> bytes:
        return self.name.encode()

    def reset(self) -> None:
        with self._lock:
            self._agents.pop(self.name, None)
            self.name = _next_generation(self.name)
            self._agents[self.name] = self
        self._peers.clear()
        self._generation += 1

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        self._peers.add(name)
        self._loaded(name)
        return name

    def remove_peer(self, name: str) -> None:
        self._peers.discard(name)

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def prepare(self, op: str, peer: str, write: RankWrite, notification: bytes = b"") -> Prepared:
        with self._lock:
            target = self._agents.get(peer)
        if peer not in self._peers or target is None or peer in self.fail_posts_to:
            raise TransferFailed(f"peer {peer} is not reachable")
        local, remote = (write.src_addr, write.dst_addr) if op == "WRITE" else (write.dst_addr, write.src_addr)
        if not spans_cover(self.spans, local, write.length) or not spans_cover(target.spans, remote, write.length):
            raise TransferFailed("descriptor outside registered memory")
        prepared = Prepared(op, peer, write, (target, notification), self._epoch(peer))
        self.prepared_live.add(prepared)
        return prepared

    def _start(self, prepared: Prepared, notification: bytes) -> Any:
        self.prepared_live.discard(prepared)
        if prepared.peer in self.fail_posts_to:
            raise TransferFailed(f"peer {prepared.peer} is not reachable")
        write, (target, built_with) = prepared.write, prepared.handle
        notification = notification or built_with
        if prepared.peer in self.stall_posts_to:
            landed = [False]
            self._stalled.append((write, target, notification, landed))
            return landed
        self._land(write, target, notification)
        return [True]

    def _land(self, write: RankWrite, target: InMemoryTransport, notification: bytes) -> None:
        for s, d, n in zip(write.src_addr.tolist(), write.dst_addr.tolist(), write.length.tolist(), strict=True):
            ctypes.memmove(d, s, n)
        if notification:  # NIXL sends none for an empty one
            with target._inbox_lock:
                target._inbox.append((self.name, notification))

    def land_stalled(self) -> int:
        """Tests: complete every stalled transfer, released or not. Returns how many."""
        stalled, self._stalled = self._stalled, []
        for write, target, notification, landed in stalled:
            self._land(write, target, notification)
            landed[0] = True
        return len(stalled)

    def discard(self, prepared: Prepared) -> None:
        self.prepared_live.discard(prepared)

    def poll(self, handle: Any) -> bool:
        return bool(handle[0])

    def release(self, handle: Any) -> None:
        pass

    def notifications(self) -> list[tuple[str, bytes]]:
        with self._inbox_lock:
            out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        with self._lock:
            self._agents.pop(self.name, None)


# -- NIXL -------------------------------------------------------------------------------------------------
def nixl_api() -> ModuleType:
    """NIXL's ``nixl`` package picks its CUDA 12 or 13 build by torch's CUDA version; beside a CPU
    build of torch it imports all of torch to learn there is none (a second of CPU per process),
    then takes the first build installed, in this order. A process that has not imported torch,
    beside a CPU torch, takes that build directly, so the tests' rank processes start a second
    sooner. Any other process goes through ``nixl``."""
    if "torch" not in sys.modules:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            if importlib.metadata.version("torch").endswith("+cpu"):
                for build in ("nixl_cu13", "nixl_cu12"):
                    try:
                        return importlib.import_module(f"{build}._api")
                    except ModuleNotFoundError as missing:
                        if missing.name != build:
                            raise
    return importlib.import_module("nixl._api")


class NixlTransport(Transport):
    """One NIXL agent. No progress thread of NIXL's own: the owning thread's ``poll`` and
    ``notifications`` calls drive progress (NIXL's spinning progress thread costs a whole core)."""

    def __init__(self, name: str, backend: str = "UCX", memory_type: str = "DRAM"):
        self.name = name
        self.backend = backend
        self.memory_type = memory_type
        self.reset_after_failure = backend == "LIBFABRIC"
        self._agent = self._new_agent(name)
        self._registrations: list[Any] = []  # NIXL's registration descriptors (nixl is untyped)
        self._registered: list[np.ndarray] = []  # every registration's rows, to repeat after a reset
        self._peers: set[str] = set()
        self._agent_lock = threading.Lock()  # reset vs the handshake executor's add/remove_peer

    def _new_agent(self, name: str) -> Any:  # a nixl_agent (nixl is untyped)
        api = nixl_api()
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[self.backend],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        agent = api.nixl_agent(name, config)
        if self.backend not in agent.backends:
            raise TransferFailed(f"NIXL backend {self.backend} did not load (loaded: {list(agent.backends)})")
        return agent

    def loaded_backends(self) -> list[str]:
        return list(self._agent.backends)

    def register(self, regions: Sequence[Region]) -> None:
        rows = np.array([[s.addr, s.length, s.device_id] for s in region_spans(regions)], dtype=np.uint64)
        self._registrations.append(self._agent.register_memory(rows, self.memory_type))
        self._registered.append(rows)

    def metadata(self) -> bytes:
        metadata: bytes = self._agent.get_agent_metadata()
        return metadata

    def add_peer(self, metadata: bytes) -> str:
        with self._agent_lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._peers.add(name)
            self._loaded(name)
        return name

    def remove_peer(self, name: str) -> None:
        with self._agent_lock:
            self._remove_peer(name)

    def _remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._peers.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # already gone on NIXL's side; nothing left to drop
                pass

    def reset(self) -> None:
        # A new name too: peers that met the old agent keep its connection state under that name,
        # and must see this one as a stranger. Registering the same memory twice is allowed, so the
        # new agent is complete before the old one lets go.
        name = _next_generation(self.name)
        agent = self._new_agent(name)
        registrations = [agent.register_memory(rows, self.memory_type) for rows in self._registered]
        with self._agent_lock:
            old, self._agent, self.name = self._agent, agent, name
            self._generation += 1
            old_registrations, self._registrations = self._registrations, registrations
            old_peers, self._peers = self._peers, set()
        for peer in old_peers:
            try:
                old.remove_remote_agent(peer)
            except Exception:
                pass
        for reg in old_registrations:
            try:
                old.deregister_memory(reg)
            except Exception:
                pass

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def _descs(self, addr: np.ndarray, length: np.ndarray, dev: np.ndarray) -> Any:  # nixl's descriptor list
        rows = np.stack([addr, length, dev.astype(np.uint64)], axis=1).astype(np.uint64)
        descs = self._agent.get_xfer_descs(rows, self.memory_type)
        if descs is None:
            raise TransferFailed("NIXL refused the descriptor list")
        return descs

    def prepare(self, op: str, peer: str, write: RankWrite, notification: bytes = b"") -> Prepared:
        epoch = self._epoch(peer)  # read first: a load racing the build makes it stale, never current
        if op == "WRITE":
            local = self._descs(write.src_addr, write.length, write.src_dev)
            remote = self._descs(write.dst_addr, write.length, write.dst_dev)
        else:
            local = self._descs(write.dst_addr, write.length, write.dst_dev)
            remote = self._descs(write.src_addr, write.length, write.src_dev)
        try:  # a notification given to transfer() instead replaces this one (NIXL's API)
            handle = self._agent.initialize_xfer(op, local, remote, peer, notification)
        except Exception as exc:
            raise TransferFailed(f"NIXL could not create the {op} to {peer}: {_nixl_reason(exc)}") from None
        return Prepared(op, peer, write, (self._agent, handle), epoch)

    def _start(self, prepared: Prepared, notification: bytes) -> Any:
        op, peer, (_, handle) = prepared.op, prepared.peer, prepared.handle
        try:
            state = self._agent.transfer(handle, notification)
        except Exception as exc:
            self._release_quietly(handle)
            raise TransferFailed(f"NIXL could not post the {op} to {peer}: {_nixl_reason(exc)}") from None
        if state == "ERR":
            self._release_quietly(handle)
            raise TransferFailed(f"NIXL failed to post the {op} to {peer}")
        return handle

    def discard(self, prepared: Prepared) -> None:
        agent, handle = prepared.handle  # a reset's old agent releases its own
        try:
            agent.release_xfer_handle(handle)
        except Exception:
            pass

    def poll(self, handle: Any) -> bool:
        try:
            state: str = self._agent.check_xfer_state(handle)
        except Exception as exc:
            raise TransferFailed(f"transfer failed: {_nixl_reason(exc)}") from None
        if state == "ERR":
            raise TransferFailed("transfer failed (NIXL reported ERR)")
        return state == "DONE"

    def release(self, handle: Any) -> None:
        self._release_quietly(handle)

    def _release_quietly(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # a failed transfer's handle may already be unusable
            pass

    def notifications(self) -> list[tuple[str, bytes]]:
        return [(peer, msg) for peer, msgs in self._agent.get_new_notifs().items() for msg in msgs]

    def close(self) -> None:
        with self._agent_lock:
            for name in list(self._peers):
                self._remove_peer(name)
        for reg in self._registrations:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
        self._registrations.clear()


def _next_generation(name: str) -> str:
    """``agent`` -> ``agent.1`` -> ``agent.2``: the name of the agent that replaces this one."""
    base, dot, generation = name.rpartition(".")
    return f"{base}.{int(generation) + 1}" if dot and generation.isdigit() else f"{name}.1"


def _nixl_reason(exc: Exception) -> str:
    """NIXL's exceptions carry only a status name; say which one in words."""
    status = type(exc).__name__.removeprefix("nixl").removesuffix("Error")
    hints = {"RemoteDisconnect": "the peer disconnected (process died or restarted)",
             "NotFound": "the peer or memory is unknown to NIXL", "InvalidParam": "invalid descriptors"}
    return hints.get(status, f"{status or type(exc).__name__}: {exc}")
