"""Reaching peer ranks: agent handshakes on their own executor, message sends that never block the
thread that owns a transport, and D's probes of the P ranks it waits on (on an executor of their
own, so a stopped P that leaves a probe hanging for ``probe_timeout_s`` delays no registration).
Shared by every transfer thread."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable

from ..protocol.messages import AgentInfo, AgentInfoRequest, Alive, Message, Probe
from .side_channel import SideChannelClient, rank_address
from .transport import MemorySpan, Transport

log = logging.getLogger(__name__)


class Peers:
    """Owns a small executor. ``on_result`` is called (on the executor) with each handshake's
    outcome; the owner forwards it into its own inbox."""

    def __init__(self, transport: Transport, client: SideChannelClient, my_address: str,
                 name: str, workers: int = 4, probe_timeout_s: float = 3.0):
        self.transport = transport
        self.client = client
        self.my_address = my_address
        self.probe_timeout_s = probe_timeout_s
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=f"neuron-disagg-{name}-peers")
        self._prober = ThreadPoolExecutor(workers, thread_name_prefix=f"neuron-disagg-{name}-probes")
        self._handshaking: set[str] = set()
        self.spans: dict[str, list[MemorySpan]] = {}  # what each peer agent told us it registered
        self.send_failures = 0

    def handshake(self, address: str, tp_rank: int, agent: str,
                  on_result: Callable[[str, str | None], None]) -> None:
        """Fetch and load the metadata of ``agent`` (rank ``tp_rank`` at ``address``) unless a
        handshake with it is already running. ``on_result(agent, error or None)``."""
        if agent in self._handshaking:
            return
        self._handshaking.add(agent)

        def run() -> None:
            error = None
            try:
                reply = self.client.request(rank_address(address, tp_rank), AgentInfoRequest(self.my_address))
                if not isinstance(reply, AgentInfo) or reply.agent_name != agent:
                    raise ValueError(f"{address} rank {tp_rank} answered as {getattr(reply, 'agent_name', reply)!r}")
                self.spans[agent] = [MemorySpan(a, n) for a, n in reply.spans]
                self.transport.add_peer(reply.metadata)
            except Exception as exc:  # any failure is the handshake's outcome, reported below
                error = f"handshake with {agent} at {address} rank {tp_rank} failed: {exc}"
            on_result(agent, error)

        self._executor.submit(run)

    def handshake_finished(self, agent: str) -> None:
        """Called by the owner once it has processed the result, so a later handshake may run."""
        self._handshaking.discard(agent)

    def send(self, address: str, ranks: tuple[int, ...], message: Message,
             on_failure: Callable[[int, str], None] | None = None) -> None:
        """Send ``message`` to each of ``ranks`` at ``address``; ``on_failure(rank, why)`` (on the
        executor) for each rank it could not be sent to. A failed send was never received whole (the
        client hands the kernel one frame in one ``sendall``, which raises only if some of it was
        not taken; a peer acts only on whole frames), so the peer never acted on it."""
        for rank in ranks:
            self._executor.submit(self._send_one, address, rank, message, on_failure)

    def _send_one(self, address: str, rank: int, message: Message,
                  on_failure: Callable[[int, str], None] | None) -> None:
        try:
            self.client.send(rank_address(address, rank), message)
        except OSError as exc:  # the peer's leases and watchdogs cover a lost message
            self.send_failures += 1
            log.warning("could not send %s for %s to %s rank %d: %s", type(message).__name__,
                        getattr(message, "transfer_id", "?"), address, rank, exc)
            if on_failure is not None:
                on_failure(rank, f"{type(exc).__name__}: {exc}")

    def probe(self, address: str, tp_rank: int, on_result: Callable[[str | None, bool], None]) -> None:
        """Ask rank ``tp_rank`` at ``address`` whether it is there. ``on_result(incarnation, refused)``
        on the prober: its ``Alive.incarnation``, or None and whether the connection was refused
        (nothing listens, reset, unreachable) rather than left unanswered (timed out)."""

        def run() -> None:
            try:
                reply = self.client.request(rank_address(address, tp_rank), Probe(time.time()),
                                            timeout_s=self.probe_timeout_s)
            except TimeoutError:  # socket.timeout: silence, which the core judges over time
                on_result(None, False)
                return
            except Exception:  # refused, reset, closed unanswered, or an answer we cannot read
                on_result(None, True)
                return
            if isinstance(reply, Alive) and reply.tp_rank == tp_rank:
                on_result(reply.incarnation, False)
            else:
                on_result(None, True)

        self._prober.submit(run)

    def shutdown(self) -> None:
        self._prober.shutdown(wait=False, cancel_futures=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.client.close()
