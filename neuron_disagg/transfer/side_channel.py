"""Our side channel: signed protocol messages over TCP between P and D ranks.

Frames are a 4-byte big-endian length followed by a ``WireCodec`` frame. Each rank of an instance
listens on ``port + tp_rank``. One server thread serves every connection and hands each verified
message to ``on_message`` (which must not block); if that returns a message, it is written back on
the same connection (used for the agent-metadata handshake). Rejected frames and connections are
counted by reason and never reach a core.
"""

from __future__ import annotations

import logging
import resource
import select
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Callable

from ..protocol.errors import MessageError, OversizeMessage
from ..protocol.messages import Message
from ..protocol.wire import WireCodec

log = logging.getLogger(__name__)
_LENGTH = struct.Struct(">I")


def rank_address(address: str, tp_rank: int) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port) + tp_rank


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, remaining = [], n
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, limit: int) -> bytes | None:
    header = _read_exact(sock, _LENGTH.size)
    if header is None:
        return None
    (length,) = _LENGTH.unpack(header)
    if length > limit:
        raise OversizeMessage(f"frame of {length} bytes exceeds the {limit}-byte limit")
    return _read_exact(sock, length)


def write_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(frame)) + frame)


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    verify_by: float  # monotonic deadline for the first verified frame
    verified: bool = False
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)


class SideChannelServer:
    """Listens on one rank's address and serves every connection from one thread.

    A hostile or broken client costs a bounded amount: a connection holds no thread, at most
    ``max_unverified`` connections may wait for their first verified frame (the oldest is closed
    to make room), each gets ``first_frame_s`` to send one of at most 1 MiB, and at most ``max_connections`` are
    open at once. A verified connection (a peer holding the deployment secret) stays open.
    """

    def __init__(self, host: str, port: int, codec: WireCodec,
                 on_message: Callable[[Message], Message | None], name: str = "side-channel", *,
                 max_connections: int = 4096, max_unverified: int = 128, first_frame_s: float = 10.0):
        self.codec = codec
        self.on_message = on_message
        self.rejected: Counter[str] = Counter()
        # Half the process's descriptors at most: the engine, NIXL and vLLM's own sockets need the rest.
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft_limit != resource.RLIM_INFINITY:
            max_connections = min(max_connections, max(8, soft_limit // 2))
        self.max_connections, self.max_unverified, self.first_frame_s = max_connections, max_unverified, first_frame_s
        # A first frame is a registration, a heartbeat or a handshake: far below this. It bounds
        # what unverified connections can make us buffer to max_unverified MiB.
        self._first_frame_bytes = min(codec.max_message_bytes, 1 << 20)
        try:
            self._sock = socket.create_server((host, port), reuse_port=False, backlog=1024)
        except OSError as e:
            raise OSError(e.errno, f"side channel cannot listen on {host}:{port} ({e.strerror}); "
                                   "set side_channel_port in the config to a free port (each TP rank "
                                   "uses port + rank)") from e
        self._sock.setblocking(False)
        bound_host, bound_port = self._sock.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Connection] = {}
        self._unverified: dict[socket.socket, _Connection] = {}  # insertion order: oldest first
        self._accept_paused_until: float | None = None  # out of descriptors: retry accepting then
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"neuron-disagg-{name}", daemon=True)

    def start(self) -> SideChannelServer:
        self._thread.start()
        return self

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _run(self) -> None:
        try:
            while not self._closing:
                timeout = min(1.0, self.first_frame_s / 4, 0.2 if self._accept_paused_until else 1.0)
                for key, events in self._selector.select(timeout=timeout):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj is not self._wake_r and key.fileobj in self._conns:
                        self._serve(self._conns[key.fileobj], events)
                now = time.monotonic()
                self._expire(now)
                if self._accept_paused_until is not None and now >= self._accept_paused_until:
                    self._accept_paused_until = None
                    self._selector.register(self._sock, selectors.EVENT_READ)
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._selector.close()

    def _serve(self, conn: _Connection, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                self._read(conn)
            if events & selectors.EVENT_WRITE and conn.sock in self._conns:
                self._flush(conn)
        except Exception:  # one connection's surprise must not end the side channel for every peer
            self.rejected["handler_error"] += 1
            log.exception("side channel closed a connection after an unexpected error")
            self._close(conn)

    def _accept(self) -> None:
        for _ in range(64):  # a flood of connections must not starve the peers already connected
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: stop listening a moment, or the loop would spin
                self.rejected["accept_failed"] += 1
                self._selector.unregister(self._sock)
                self._accept_paused_until = time.monotonic() + 0.2
                return
            while self._unverified and (len(self._unverified) >= self.max_unverified
                                        or len(self._conns) >= self.max_connections):
                self._evict_oldest_unverified()
            if len(self._conns) >= self.max_connections:  # every slot held by a verified peer
                self.rejected["connection_limit"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Connection(sock, time.monotonic() + self.first_frame_s)
            self._conns[sock] = self._unverified[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _evict_oldest_unverified(self) -> None:
        oldest = next(iter(self._unverified.values()))
        self._read(oldest)  # a peer's frame already waiting in the kernel verifies it
        if oldest.sock in self._unverified:
            self.rejected["unverified_limit"] += 1
            self._close(oldest)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbox += data
        while len(conn.inbox) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(conn.inbox)
            limit = self.codec.max_message_bytes if conn.verified else self._first_frame_bytes
            if length > limit:
                self.rejected["oversize"] += 1
                log.warning("side channel closed a connection: a frame of %d bytes exceeds the %d-byte limit",
                            length, limit)
                self._close(conn)
                return
            if len(conn.inbox) < _LENGTH.size + length:
                return
            frame = bytes(conn.inbox[_LENGTH.size:_LENGTH.size + length])
            del conn.inbox[:_LENGTH.size + length]
            if not self._handle(conn, frame) or conn.sock not in self._conns:
                return

    def _handle(self, conn: _Connection, frame: bytes) -> bool:
        """Verify and deliver one frame; False if the connection was closed for it."""
        try:
            message = self.codec.decode(frame)
        except MessageError as exc:
            self.rejected[exc.reason] += 1
            log.warning("side channel rejected a message: %s", exc)
            if not conn.verified:  # nobody with the secret sent this: stop reading it
                self._close(conn)
                return False
            return True
        if not conn.verified:
            conn.verified = True
            del self._unverified[conn.sock]
        reply = self.on_message(message)
        if reply is not None:
            conn.outbox += _LENGTH.pack(len(frame := self.codec.encode(reply))) + frame
            self._flush(conn)
        return True

    def _flush(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        del conn.outbox[:sent]
        self._selector.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbox else 0))

    def _expire(self, now: float) -> None:
        for conn in list(self._unverified.values()):
            if conn.verify_by > now:
                break  # oldest first: the rest are younger
            self.rejected["first_frame_timeout"] += 1
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        self._conns.pop(conn.sock, None)
        self._unverified.pop(conn.sock, None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def close(self) -> None:
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.ident is not None:  # started (a rank that failed to start closes it unstarted)
            self._thread.join(timeout=2)
        else:
            self._selector.close()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """The peer closed or reset this connection. Polled first, without waiting: a socket with a
    timeout waits that long in ``recv`` even when asked not to block."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False  # open, nothing to read
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""  # end of stream; else a reply we did not read
    except OSError:
        return True


class SideChannelClient:
    """Sends to peers' side channels; one cached connection per peer address."""

    def __init__(self, codec: WireCodec, timeout_s: float = 2.0):
        self.codec = codec
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, int], socket.socket] = {}
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._lock = threading.Lock()

    def _peer_lock(self, addr: tuple[str, int]) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(addr, threading.Lock())

    def _connect(self, addr: tuple[str, int]) -> socket.socket:
        sock = self._conns.get(addr)
        if sock is not None and _closed_by_peer(sock):
            # The peer went away (a P restarted at the same address): a frame written into this
            # socket would be accepted by the kernel and lost, and D would wait out its watchdog.
            self._drop(addr)
            sock = None
        if sock is None:
            sock = socket.create_connection(addr, timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns[addr] = sock
        return sock

    def _drop(self, addr: tuple[str, int]) -> None:
        sock = self._conns.pop(addr, None)
        if sock is not None:
            sock.close()

    def send(self, addr: tuple[str, int], message: Message) -> None:
        """Send one message; raises OSError if the peer cannot be reached (after one reconnect)."""
        frame = self.codec.encode(message)
        with self._peer_lock(addr):
            for attempt in (1, 2):
                try:
                    write_frame(self._connect(addr), frame)
                    return
                except OSError:
                    self._drop(addr)
                    if attempt == 2:
                        raise

    def request(self, addr: tuple[str, int], message: Message, timeout_s: float | None = None) -> Message:
        """Send one message and read the single reply on a fresh connection, each socket operation
        within ``timeout_s`` (the client's by default)."""
        with socket.create_connection(addr, timeout=timeout_s or self.timeout_s) as sock:
            write_frame(sock, self.codec.encode(message))
            frame = read_frame(sock, self.codec.max_message_bytes)
        if frame is None:
            raise OSError(f"{addr[0]}:{addr[1]} closed the connection without answering")
        return self.codec.decode(frame)

    def close(self) -> None:
        with self._lock:
            for addr in list(self._conns):
                self._drop(addr)
