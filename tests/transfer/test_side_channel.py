"""The side channel's server against clients that do not hold the secret, stall, or flood it:
what it costs stays bounded, and peers holding the secret are still served."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from neuron_disagg.protocol import AgentInfoRequest, Heartbeat, TransferId, WireCodec
from neuron_disagg.transfer.side_channel import SideChannelClient, SideChannelServer, rank_address, write_frame

SECRET = b"0123456789abcdef0123456789abcdef"
HEARTBEAT = Heartbeat(TransferId("r", 0), 1.0)


@pytest.fixture
def server():
    made = []

    def start(port=0, **limits):
        got: list = []

        def on_message(message):
            got.append(message)
            return HEARTBEAT if isinstance(message, AgentInfoRequest) else None

        made.append(SideChannelServer("127.0.0.1", port, WireCodec(SECRET), on_message, **limits).start())
        made[-1].got = got
        return made[-1]

    yield start
    for s in made:
        s.close()


def wait(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def connect(srv) -> socket.socket:
    return socket.create_connection(rank_address(srv.address, 0), timeout=5)


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_peer_with_the_secret_is_answered_and_stays_connected_past_the_first_frame_deadline(server):
    srv = server(first_frame_s=1.0)  # the first frame must still come in time on a loaded machine
    client = SideChannelClient(WireCodec(SECRET))
    addr = rank_address(srv.address, 0)
    assert client.request(addr, AgentInfoRequest("d")) == HEARTBEAT
    client.send(addr, HEARTBEAT)
    kept = client._conns[addr]
    time.sleep(1.3)  # past the deadline: verified connections are not expired
    client.send(addr, HEARTBEAT)
    wait(lambda: srv.got.count(HEARTBEAT) == 2)
    assert srv.connections == 1 and not srv.rejected
    assert client._conns[addr] is kept  # the live connection is reused, not taken for a dead one
    client.close()


def test_a_peer_restarted_at_the_same_address_gets_the_next_message_not_the_dead_connection(server):
    """A P that died and came back on its port: the client's cached connection to the old one
    is dead, and a frame written into it would vanish (D then waits out its watchdog)."""
    first = server()
    addr = rank_address(first.address, 0)
    client = SideChannelClient(WireCodec(SECRET))
    client.send(addr, HEARTBEAT)
    wait(lambda: first.got == [HEARTBEAT])
    first.close()
    second = server(port=addr[1])
    client.send(addr, HEARTBEAT)
    wait(lambda: second.got == [HEARTBEAT])
    client.close()


@pytest.mark.parametrize("frame, reason", [
    (WireCodec(b"not-this-deployments-secret-at-all").encode(HEARTBEAT), "bad_signature"),
    (b"not msgpack at all", "malformed"),
])
def test_a_frame_without_the_secret_closes_its_connection_and_is_counted(server, frame, reason):
    srv = server()
    sock = connect(srv)
    write_frame(sock, frame)
    write_frame(sock, WireCodec(SECRET).encode(HEARTBEAT))  # too late: nobody reads on
    assert closed_by_server(sock)
    assert srv.rejected[reason] == 1 and not srv.got


def test_a_stalled_or_silent_connection_is_closed_at_the_first_frame_deadline(server):
    srv = server(first_frame_s=0.3)
    started = time.monotonic()  # before the server accepts, when its deadline starts
    silent, stalled = connect(srv), connect(srv)
    stalled.sendall(struct.pack(">I", 200) + b"x" * 50)  # a frame that never completes
    assert closed_by_server(silent) and closed_by_server(stalled)
    assert 0.25 < time.monotonic() - started < 5.0
    assert srv.rejected["first_frame_timeout"] == 2 and srv.connections == 0


def test_a_first_frame_longer_than_a_registration_can_be_is_refused_before_it_is_buffered(server):
    srv = server()
    sock = connect(srv)
    sock.sendall(struct.pack(">I", 2 << 20))
    assert closed_by_server(sock)
    assert srv.rejected["oversize"] == 1


def test_a_flood_of_unverified_connections_holds_no_threads_and_evicts_the_oldest(server):
    srv = server(max_unverified=8, first_frame_s=30)
    threads = threading.active_count()
    flood = [connect(srv) for _ in range(200)]
    # the 200th evicts the oldest before it is counted itself: wait for both
    wait(lambda: srv.rejected["unverified_limit"] == 192 and srv.connections == 8)
    assert threading.active_count() == threads
    # A peer holding the secret is served amid the flood, and its connection survives more of it.
    peer = connect(srv)
    write_frame(peer, WireCodec(SECRET).encode(HEARTBEAT))
    wait(lambda: srv.got == [HEARTBEAT])
    more = [connect(srv) for _ in range(20)]
    wait(lambda: srv.rejected["unverified_limit"] == 212)
    write_frame(peer, WireCodec(SECRET).encode(HEARTBEAT))
    wait(lambda: srv.got == [HEARTBEAT, HEARTBEAT])
    for sock in flood + more + [peer]:
        sock.close()


def test_a_new_connection_takes_an_unverified_ones_place_and_is_refused_only_when_peers_fill_every_slot(server):
    srv = server(max_connections=3, max_unverified=3)
    stalled = [connect(srv) for _ in range(3)]
    wait(lambda: srv.connections == 3)
    peers = [socket.create_connection(rank_address(srv.address, 0), timeout=5) for _ in range(3)]
    for sock in peers:  # each evicts the oldest stalled one, then verifies itself
        write_frame(sock, WireCodec(SECRET).encode(HEARTBEAT))
    wait(lambda: len(srv.got) == 3)
    assert all(closed_by_server(sock) for sock in stalled) and srv.rejected["unverified_limit"] == 3
    extra = connect(srv)
    assert closed_by_server(extra)
    assert srv.rejected["connection_limit"] == 1
    for sock in peers:
        sock.close()


def test_an_error_in_the_handler_closes_that_connection_only(server):
    srv = server()
    calls = []

    def on_message(message):
        calls.append(message)
        if len(calls) == 1:
            raise RuntimeError("a bug in whoever consumes messages")
        return None

    srv.on_message = on_message
    first, second = SideChannelClient(WireCodec(SECRET)), SideChannelClient(WireCodec(SECRET))
    addr = rank_address(srv.address, 0)
    first.send(addr, HEARTBEAT)
    wait(lambda: srv.rejected["handler_error"] == 1)
    second.send(addr, HEARTBEAT)  # the server still serves
    wait(lambda: len(calls) == 2)
    first.close()
    second.close()


OUT_OF_DESCRIPTORS = r"""
import os, resource, socket, sys, time
from neuron_disagg.protocol import WireCodec
from neuron_disagg.transfer.side_channel import SideChannelServer
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
srv = SideChannelServer("127.0.0.1", 0, WireCodec(b"0123456789abcdef0123456789abcdef"), lambda m: None).start()
hog = []
try:
    while True:
        hog.append(os.open(os.devnull, os.O_RDONLY))  # every descriptor left: accept() must fail
except OSError:
    pass
print(srv.address, srv.max_connections, flush=True)
sys.stdin.readline()  # the test has connected
start = time.process_time()
time.sleep(2.0)
print(time.process_time() - start, srv.rejected["accept_failed"], flush=True)
for fd in hog[:8]:
    os.close(fd)
deadline = time.monotonic() + 10
while srv.connections < 3 and time.monotonic() < deadline:  # its pause after a failed accept ends
    time.sleep(0.05)
print(srv.connections, flush=True)
"""


@pytest.mark.integration  # a child process with few descriptors
def test_out_of_descriptors_the_server_neither_spins_nor_stops_accepting():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", OUT_OF_DESCRIPTORS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        address, cap = proc.stdout.readline().split()
        assert int(cap) == 32  # half the 64 descriptors it may hold
        pending = [socket.create_connection(rank_address(address, 0), timeout=5) for _ in range(3)]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        cpu_s, failed = proc.stdout.readline().split()
        assert int(failed) >= 1 and float(cpu_s) < 0.5, (cpu_s, failed)  # paused, not spinning on accept()
        assert int(proc.stdout.readline()) == 3  # descriptors back: the waiting connections are served
        for sock in pending:
            sock.close()
    finally:
        proc.kill()
        proc.wait(10)
