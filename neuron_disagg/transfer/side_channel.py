"""Our side channel: signed protocol messages over TCP between P and D ranks.

Frames are a 4-byte big-endian length followed by a ``WireCodec`` frame. Each rank of an instance
listens on ``port + tp_rank``. A server thread accepts connections and hands every verified message
to ``on_message``; if that returns a message, it is written back on the same connection (used for
the agent-metadata handshake). Rejected frames are counted by reason and never reach a core.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections import Counter
from typing import Callable

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


class SideChannelServer:
    """Listens on one rank's address; one short-lived thread per connected peer."""

    def __init__(self, host: str, port: int, codec: WireCodec,
                 on_message: Callable[[Message], Message | None], name: str = "side-channel"):
        self.codec = codec
        self.on_message = on_message
        self.rejected: Counter[str] = Counter()
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise OSError(e.errno, f"side channel cannot listen on {host}:{port} ({e.strerror}); "
                                   "set side_channel_port in the config to a free port (each TP rank "
                                   "uses port + rank)") from e
        self.address = "%s:%d" % self._sock.getsockname()[:2]
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"neuron-disagg-{name}", daemon=True)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> "SideChannelServer":
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"{self._thread.name}-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                frame = read_frame(conn, self.codec.max_message_bytes)
                if frame is None:
                    return
                try:
                    message = self.codec.decode(frame)
                except MessageError as exc:
                    self.rejected[exc.reason] += 1
                    log.warning("side channel rejected a message: %s", exc)
                    continue
                reply = self.on_message(message)
                if reply is not None:
                    write_frame(conn, self.codec.encode(reply))
        except OversizeMessage as exc:
            self.rejected[exc.reason] += 1
            log.warning("side channel closed a connection: %s", exc)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closing.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=2)


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

    def request(self, addr: tuple[str, int], message: Message) -> Message:
        """Send one message and read the single reply on a fresh connection."""
        with socket.create_connection(addr, timeout=self.timeout_s) as sock:
            write_frame(sock, self.codec.encode(message))
            frame = read_frame(sock, self.codec.max_message_bytes)
        if frame is None:
            raise OSError(f"{addr[0]}:{addr[1]} closed the connection without answering")
        return self.codec.decode(frame)

    def close(self) -> None:
        with self._lock:
            for addr in list(self._conns):
                self._drop(addr)
