"""A real prefill process's side channel under 20,000 connections from a client without the secret,
half of them stalled mid-frame: its threads and memory stay bounded and transfers go on."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

from .test_push_faults import _deliver

pytestmark = pytest.mark.integration
CONNECTIONS, WAVE = 20_000, 2_000


def _status(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"threads": int(fields["Threads"]), "rss_kib": int(fields["VmRSS"].split()[0])}


def _wave(address: str, count: int) -> tuple[list[socket.socket], int]:
    host, port = address.rsplit(":", 1)
    opened, refused = [], 0
    for i in range(count):
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            if i % 2:  # stalled mid-frame: a header promising 300 bytes, then 40 of them
                sock.sendall(struct.pack(">I", 300) + b"\x93" * 40)
            opened.append(sock)
        except OSError:  # the server closed it already, or its backlog was full
            refused += 1
    return opened, refused


def test_twenty_thousand_hostile_connections_cost_no_threads_and_transfers_go_on(ucx_peers):
    peers = ucx_peers
    p = peers("prefill", "--lease-s", "60")
    d = peers("decode", "--watchdog-s", "30")
    _deliver(p, d, ["warm", 0], [1, 2], [3, 4], seed=1)
    before = _status(p.proc.pid)
    peak = dict(before)
    for n in range(CONNECTIONS // WAVE):
        held, _ = _wave(p.address, WAVE)
        _deliver(p, d, [f"during-{n}", 0], [5, 6, 7], [8, 9, 10], seed=n + 2)  # while they are held
        now = _status(p.proc.pid)
        peak = {k: max(peak[k], now[k]) for k in peak}
        for sock in held:
            sock.close()
    stats = p.call("stats")
    assert peak["threads"] <= before["threads"] + 1, (before, peak)
    assert peak["rss_kib"] - before["rss_kib"] < 64 * 1024, (before, peak)
    rejected = stats["rejected"]
    assert rejected.get("unverified_limit", 0) + rejected.get("first_frame_timeout", 0) >= CONNECTIONS // 2, rejected
    assert stats["outstanding_blocks"] == 0
