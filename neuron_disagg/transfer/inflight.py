"""A transfer thread's in-flight WRITEs or READs: posting per peer rank, parking parts whose peer
agent is not loaded yet (its handshake runs on the peers executor), polling, and releasing.

Before posting, the remote side of every descriptor is checked against the memory the peer's agent
said it registered (invariant I6): a registration or offer pointing anywhere else never becomes a
transfer.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from ..protocol.messages import TransferId
from ..protocol.plan import RankWrite
from .peers import Peers
from .transport import TransferFailed, Transport, spans_cover


@dataclass(frozen=True)
class Part:
    """One sub-transfer: a plan between us and one peer rank."""

    peer_address: str
    peer_rank: int
    plan: RankWrite


@dataclass
class _Batch:
    op: str
    frame: bytes  # the signed notification that rides on every part
    handles: list[Any] = field(default_factory=list)
    parked: list[Part] = field(default_factory=list)
    agents: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.perf_counter)


class InFlight:
    def __init__(self, transport: Transport, peers: Peers,
                 on_peer_ready: Callable[[str, str | None], None], stats: Counter):
        self.transport, self.peers = transport, peers
        self.on_peer_ready = on_peer_ready
        self.stats = stats
        self.post_seconds: list[float] = []   # submit -> every part posted (or parked)
        self.done_seconds: list[float] = []   # submit -> every part complete
        self._batches: dict[TransferId, _Batch] = {}

    def __bool__(self) -> bool:
        return bool(self._batches)

    def _remote(self, op: str, part: Part):
        p = part.plan
        return (p.remote_agent, p.dst_addr) if op == "WRITE" else (p.remote_agent, p.src_addr)

    def submit(self, tid: TransferId, op: str, parts: list[Part], frame: bytes) -> str | None:
        """Post every part (or park it until its peer is known). Returns a failure reason, or None."""
        batch = _Batch(op, frame)
        self._batches[tid] = batch
        for part in parts:
            batch.agents.add(part.plan.remote_agent)
            if self.transport.has_peer(part.plan.remote_agent):
                error = self._post(batch, part)
                if error:
                    self.release(tid)
                    return error
            else:
                batch.parked.append(part)
                self.peers.handshake(part.peer_address, part.peer_rank, part.plan.remote_agent, self.on_peer_ready)
        self.post_seconds.append(time.perf_counter() - batch.started)
        return None

    def _post(self, batch: _Batch, part: Part) -> str | None:
        agent, remote_addr = self._remote(batch.op, part)
        spans = self.peers.spans.get(agent)
        if spans is not None and not spans_cover(spans, remote_addr, part.plan.length):
            self.stats["registration_rejected"] += 1
            return f"registration rejected: the transfer would touch memory {agent} never registered"
        try:
            batch.handles.append(self.transport.post(batch.op, agent, part.plan, batch.frame))
        except TransferFailed as exc:
            self._forget_dead_peer(str(exc), agent)
            return str(exc)
        self.stats["descriptors"] += len(part.plan)
        self.stats["bytes"] += part.plan.bytes
        return None

    def peer_ready(self, agent: str, error: str | None) -> list[tuple[TransferId, str]]:
        """A handshake ended: post what waited for ``agent``. Returns transfers that failed."""
        self.peers.handshake_finished(agent)
        failed = []
        for tid, batch in list(self._batches.items()):
            waiting = [p for p in batch.parked if p.plan.remote_agent == agent]
            for part in waiting:
                batch.parked.remove(part)
                problem = error or self._post(batch, part)
                if problem:
                    self.release(tid)
                    failed.append((tid, problem))
                    break
        return failed

    def poll(self) -> tuple[list[TransferId], list[tuple[TransferId, str]]]:
        done, failed = [], []
        for tid, batch in list(self._batches.items()):
            try:
                finished = all([self.transport.poll(h) for h in batch.handles])
            except TransferFailed as exc:
                for agent in batch.agents:
                    self._forget_dead_peer(str(exc), agent)
                self.release(tid)
                failed.append((tid, str(exc)))
                continue
            if finished and not batch.parked:
                self.done_seconds.append(time.perf_counter() - batch.started)
                self.release(tid)
                done.append(tid)
        return done, failed

    def release(self, tid: TransferId) -> None:
        batch = self._batches.pop(tid, None)
        for handle in batch.handles if batch else ():
            self.transport.release(handle)

    def tids(self) -> list[TransferId]:
        return list(self._batches)

    def _forget_dead_peer(self, reason: str, agent: str) -> None:
        # A failed transfer may mean a dead peer (UCX says "disconnect"; LIBFABRIC reports a
        # backend error): forget its agent, so a restarted peer is handshaken with fresh metadata.
        self.transport.remove_peer(agent)
