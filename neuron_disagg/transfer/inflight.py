"""A transfer thread's in-flight WRITEs or READs: posting per peer rank, parking parts whose peer
agent is not loaded yet (its handshake runs on the peers executor), polling, and releasing.

Before posting, the remote side of every descriptor is checked against the memory the peer's agent
said it registered (invariant I6): a registration or offer pointing anywhere else never becomes a
transfer.

A transfer's parts may be built ahead (``prepare``, from P's writer while the forward that computes
the KV runs); ``submit`` then posts those it finds built for exactly its parts and to a peer still
as loaded, and builds the rest. What is built and not submitted is released by ``discard_prepared``
or ``keep_prepared``; a reset releases all of it first.

Where a failed transfer can leave the agent itself unusable (``Transport.reset_after_failure``),
a failure starts a drain: new parts are parked, and once nothing posted is still running the agent
is replaced and every parked part handshakes again with the new one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from ..protocol.messages import TransferId
from ..protocol.plan import RankWrite
from .peers import Peers
from .transport import Prepared, TransferFailed, Transport, spans_cover

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """One sub-transfer: a plan between us and one peer rank, posted once ``gate`` (if any) says
    the bytes it reads are final (streaming by layers: the layers it covers ran)."""

    peer_address: str
    peer_rank: int
    plan: RankWrite
    gate: Callable[[], bool] | None = None


@dataclass
class _Batch:
    op: str
    frame: bytes  # the signed notification that rides on every part
    handles: list[Any] = field(default_factory=list)
    parked: list[Part] = field(default_factory=list)
    gated: list[Part] = field(default_factory=list)  # their gate not open yet: posted by poll
    agents: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.perf_counter)
    # Why a part failed, while others posted may still be landing: reported once all have ended, so
    # the peer is not told (and frees its blocks) under a part still writing into them.
    failure: str | None = None


class InFlight:
    def __init__(self, transport: Transport, peers: Peers,
                 on_peer_ready: Callable[[str, str | None], None], stats: Counter[str]):
        self.transport, self.peers = transport, peers
        self.on_peer_ready = on_peer_ready
        self.stats = stats
        self.post_seconds: list[float] = []   # submit -> every part posted (or parked)
        self.done_seconds: list[float] = []   # submit -> every part complete
        self._batches: dict[TransferId, _Batch] = {}
        self._prepared: dict[TransferId, tuple[object, list[Prepared]]] = {}  # tid -> (key, built parts)
        self._draining = False  # a failure asked for a new agent; it comes once nothing runs
        self._reset_not_before = 0.0

    def __bool__(self) -> bool:
        return bool(self._batches) or self._draining

    def moving(self) -> bool:
        """Something is posted, parked for a peer, or draining: what only polling advances. (Parts
        that wait on their gate alone go when the engine says the gate may have opened.)"""
        return self._draining or any(b.handles or b.parked for b in self._batches.values())

    def _registered(self, agent: str, op: str, plan: RankWrite) -> bool:
        """I6: the remote side lies in memory ``agent`` registered (unknown spans: NIXL checks)."""
        spans = self.peers.spans.get(agent)
        remote = plan.dst_addr if op == "WRITE" else plan.src_addr
        return spans is None or spans_cover(spans, remote, plan.length)

    def prepare(self, tid: TransferId, op: str, plans: tuple[RankWrite, ...], key: object) -> None:
        """Build the parts of a transfer to come whose peer agent is loaded, replacing what was
        built for ``tid`` before; ``key`` is what ``keep_prepared`` later judges them by. A part
        that cannot be built is left to ``submit``, which builds it again and reports why."""
        self.discard_prepared(tid)
        if self._draining:
            return
        built = []
        for plan in plans:
            if self.transport.has_peer(plan.remote_agent) and self._registered(plan.remote_agent, op, plan):
                try:
                    built.append(self.transport.prepare(op, plan.remote_agent, plan))
                except TransferFailed:
                    pass
        if built:
            self._prepared[tid] = (key, built)

    def discard_prepared(self, tid: TransferId) -> None:
        for prepared in self._prepared.pop(tid, (None, ()))[1]:
            self.transport.discard(prepared)

    def keep_prepared(self, still_wanted: Callable[[TransferId, object], bool]) -> None:
        """Release what was built for transfers whose key ``still_wanted`` no longer accepts."""
        for tid, (key, _) in list(self._prepared.items()):
            if not still_wanted(tid, key):
                self.discard_prepared(tid)

    def submit(self, tid: TransferId, op: str, parts: list[Part], frame: bytes) -> str | None:
        """Post every part (or park it until its peer is known). Returns a failure reason, or None.
        A write of chunks (no ``frame``) leaves what was built ahead, for the transfer's last write."""
        batch = _Batch(op, frame)
        self._batches[tid] = batch
        built = self._prepared.pop(tid, (None, []))[1] if frame else []
        try:
            for part in parts:
                batch.agents.add(part.plan.remote_agent)
                if part.gate is not None and not part.gate():
                    batch.gated.append(part)
                    continue
                error = self._place(batch, part, built)
                if error and batch.handles:  # others posted: the failure waits for them
                    batch.failure, batch.parked, batch.gated = error, [], []
                    break
                if error:
                    self.release(tid)
                    return error
        finally:
            for prepared in built:  # built for parts this submit does not have
                self.transport.discard(prepared)
        self.post_seconds.append(time.perf_counter() - batch.started)
        return None

    def _place(self, batch: _Batch, part: Part, built: list[Prepared] | None = None) -> str | None:
        """Post ``part`` now (with what was built for it), or park it until its peer is known."""
        if self._draining:
            batch.parked.append(part)  # handshaken with the new agent, after the reset
        elif self.transport.has_peer(part.plan.remote_agent):
            prepared = next((p for p in built or () if p.write is part.plan and p.op == batch.op), None)
            if prepared is not None:
                built.remove(prepared)  # type: ignore[union-attr]  # found in it
            return self._post(batch, part, prepared)
        else:
            batch.parked.append(part)
            self._handshake(part)
        return None

    def gated(self) -> list[TransferId]:
        """Transfers with parts still waiting on their gate."""
        return [tid for tid, batch in self._batches.items() if batch.gated]

    def drop_gated(self, tid: TransferId) -> None:
        """The owner gave the write up (cancelled, timed out, its registration lapsed): the parts
        not posted never will be; the write ends with those already posted."""
        batch = self._batches.get(tid)
        if batch is not None and batch.gated:
            self.stats["gated_parts_dropped"] += len(batch.gated)
            batch.gated = []

    def _open_gates(self, batch: _Batch) -> str | None:
        """Post the gated parts whose gate opened; a failure reason if one failed."""
        for part in [p for p in batch.gated if p.gate()]:  # type: ignore[misc]  # gated parts have one
            batch.gated.remove(part)
            error = self._place(batch, part)
            if error:
                batch.gated = []
                return error
        return None

    def _post(self, batch: _Batch, part: Part, prepared: Prepared | None = None) -> str | None:
        agent = part.plan.remote_agent
        try:
            # Built for this very plan, against the peer as now loaded (else start refuses it), so
            # it passed the registered-memory check then; checking 100k descriptors costs a ms.
            handle = self.transport.start(prepared, batch.frame) if prepared is not None else None
            if handle is not None:
                self.stats["prepared_posted"] += 1
            else:
                if not self._registered(agent, batch.op, part.plan):
                    self.stats["registration_rejected"] += 1
                    return f"registration rejected: the transfer would touch memory {agent} never registered"
                handle = self.transport.post(batch.op, agent, part.plan, batch.frame)
            batch.handles.append(handle)
        except TransferFailed as exc:
            self._forget_dead_peer(str(exc), agent)
            return str(exc)
        self.stats["descriptors"] += len(part.plan)
        self.stats["bytes"] += part.plan.bytes
        return None

    def _handshake(self, part: Part) -> None:
        self.peers.handshake(part.peer_address, part.peer_rank, part.plan.remote_agent, self.on_peer_ready)

    def peer_ready(self, agent: str, error: str | None) -> list[tuple[TransferId, str]]:
        """A handshake ended: post what waited for ``agent``. Returns transfers that failed."""
        self.peers.handshake_finished(agent)
        if self._draining:
            return []  # the parts stay parked; they handshake again with the new agent
        failed = []
        for tid, batch in list(self._batches.items()):
            waiting = [p for p in batch.parked if p.plan.remote_agent == agent]
            if waiting and error is None and not self.transport.has_peer(agent):
                self._handshake(waiting[0])  # loaded into the agent a reset replaced
                continue
            for part in waiting:
                batch.parked.remove(part)
                problem = error or self._post(batch, part)
                if problem and batch.handles:  # others posted: the failure waits for them (poll)
                    batch.failure, batch.parked, batch.gated = problem, [], []
                    break
                if problem:
                    self.release(tid)
                    failed.append((tid, problem))
                    break
        return failed

    def poll(self) -> tuple[list[TransferId], list[tuple[TransferId, str]]]:
        done, failed = [], []
        running = False
        for tid, batch in list(self._batches.items()):
            if batch.gated and batch.failure is None:
                error = self._open_gates(batch)
                if error and not batch.handles:
                    self.release(tid)
                    failed.append((tid, error))
                    continue
                if error:  # others posted: the failure waits for them
                    batch.failure, batch.parked = error, []
            finished = True
            for handle in batch.handles:
                try:
                    finished = self.transport.poll(handle) and finished
                except TransferFailed as exc:  # this part ended; the others may still be landing
                    if batch.failure is None:
                        batch.failure, batch.parked, batch.gated = str(exc), [], []
                        for agent in batch.agents:
                            self._forget_dead_peer(str(exc), agent)
            if batch.failure is not None:
                if finished:
                    self.release(tid)
                    failed.append((tid, batch.failure))
                else:
                    running = True
                continue
            if finished and not batch.parked and not batch.gated:
                if batch.frame:  # a transfer's last write; not one of chunks while the prefill ran
                    self.done_seconds.append(time.perf_counter() - batch.started)
                self.release(tid, keep_prepared=not batch.frame)
                done.append(tid)
            running = running or not finished
        if self._draining and not running and time.monotonic() >= self._reset_not_before:
            failed.extend(self._reset())
        return done, failed

    def _reset(self) -> list[tuple[TransferId, str]]:
        """Replace the agent; parked parts handshake again. Returns transfers that failed."""
        for tid in list(self._prepared):
            self.discard_prepared(tid)
        for batch in self._batches.values():  # all complete: the old agent's handles go with it
            for handle in batch.handles:
                self.transport.release(handle)
            batch.handles.clear()
        old = self.transport.name
        try:
            self.transport.reset()
        except Exception as exc:
            log.exception("could not replace NIXL agent %s", old)
            reason = f"the NIXL agent could not be replaced after a failed transfer: {exc}"
            failed = [(tid, reason) for tid in self.tids()]
            for tid in self.tids():
                self.release(tid)
            self._reset_not_before = time.monotonic() + 1.0  # still draining: try again then
            return failed
        self._draining = False
        self.stats["agent_resets"] += 1
        log.warning("replaced NIXL agent %s by %s after a failed transfer", old, self.transport.name)
        for batch in self._batches.values():
            for part in {p.plan.remote_agent: p for p in batch.parked}.values():
                self._handshake(part)
        return []

    def release(self, tid: TransferId, keep_prepared: bool = False) -> None:
        if not keep_prepared:
            self.discard_prepared(tid)
        batch = self._batches.pop(tid, None)
        for handle in batch.handles if batch else ():
            self.transport.release(handle)

    def tids(self) -> list[TransferId]:
        return list(self._batches)

    def _forget_dead_peer(self, reason: str, agent: str) -> None:
        # A failed transfer may mean a dead peer (UCX says "disconnect"; LIBFABRIC reports a
        # backend error): forget its agent, so a restarted peer is handshaken with fresh metadata.
        self.transport.remove_peer(agent)
        if self.transport.reset_after_failure and not self._draining:
            self._draining = True
            log.warning("transfer with %s failed (%s); replacing agent %s once nothing is in flight",
                        agent, reason, self.transport.name)
