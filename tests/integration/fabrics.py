"""The NIXL backends the cross-process transfer tests run over: UCX on loopback, and LIBFABRIC —
the EFA backend of trn2 and p5en — through libfabric's tcp provider.

LIBFABRIC needs libfabric 2.1.0 and a few libraries this machine lacks (``scripts/libfabric.sh``
builds and caches them; ``scripts/setup.sh`` runs it), and its tcp provider ignores the loopback
interface. So its peers run inside a private network namespace holding only ``lo`` and a veth pair
on 198.18.0.0/24 (a benchmarking range): no test traffic can reach the machine's own address."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from neuron_disagg.testing.peer_process import PeerProcess

REPO = Path(__file__).resolve().parents[2]
NAMESPACE_SETUP = ("ip link set lo up && ip link add v0 type veth peer name v1 && "
                   "ip addr add 198.18.0.1/24 dev v0 && ip link set v0 up && ip link set v1 up && "
                   "touch {ready} && exec sleep 1000000")


@dataclass
class Fabric:
    backend: str
    env: dict = field(default_factory=dict)
    prefix: tuple[str, ...] = ()
    holder: subprocess.Popen | None = None

    def peer(self, role: str, *args: str) -> PeerProcess:
        return PeerProcess(role, "--backend", self.backend, *args, env=self.env, prefix=self.prefix)

    def send(self, address: str, secret: bytes, message) -> None:
        """Sends one signed message to a side channel the way any host on the peers' network could
        (from inside their namespace when they have one)."""
        from neuron_disagg.protocol import WireCodec

        frame = WireCodec(secret).encode(message)
        sender = ("import socket, sys, time; from neuron_disagg.transfer.side_channel import write_frame; "
                  "host, port = sys.argv[1].rsplit(':', 1); s = socket.create_connection((host, int(port))); "
                  "write_frame(s, sys.stdin.buffer.read()); time.sleep(0.2); s.close()")
        subprocess.run([*self.prefix, sys.executable, "-c", sender, address], input=frame, check=True, timeout=30)

    def close(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(10)


@contextmanager
def peers_on(fabric: Fabric):
    """A function starting peer processes on ``fabric``; every one it started is killed on exit."""
    started: list[PeerProcess] = []

    def start(role: str, *args: str) -> PeerProcess:
        started.append(fabric.peer(role, *args))
        return started[-1]

    try:
        yield start
    finally:
        for proc in started:
            proc.kill()


def ucx() -> Fabric:
    return Fabric("UCX")


def libfabric_libs() -> str:
    """The directory scripts/libfabric.sh built (first time) or cached. Raises with the reason if the
    machine cannot: the tests then fail, since set-up is expected to have prepared it."""
    built = subprocess.run(["bash", str(REPO / "scripts" / "libfabric.sh")], capture_output=True, text=True,
                           timeout=1800)
    if built.returncode != 0:
        raise RuntimeError(f"scripts/libfabric.sh failed:\n{built.stderr[-3000:]}")
    return built.stdout.strip().splitlines()[-1].removeprefix("LIBFABRIC_LIBS=")


def libfabric_alone(directory: Path) -> Path:
    """A directory holding libfabric and nothing else, as the EFA installer's /opt/amazon/efa/lib."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "libfabric.so.1").symlink_to(Path(libfabric_libs(), "libfabric.so.1").resolve())
    return directory


def libfabric(tmp: Path) -> Fabric:
    """The libraries (scripts/libfabric.sh), then a private network namespace for the peers."""
    libs = libfabric_libs()
    ready = tmp / "netns-ready"
    holder = subprocess.Popen(["unshare", "-n", "--", "sh", "-c", NAMESPACE_SETUP.format(ready=ready)],
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not ready.exists():
        if holder.poll() is not None or time.monotonic() > deadline:
            holder.kill()
            raise RuntimeError(f"could not create the test network namespace: {holder.stderr.read()}")
        time.sleep(0.05)
    env = {"LD_LIBRARY_PATH": ":".join(p for p in (libs, os.environ.get("LD_LIBRARY_PATH")) if p),
           "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "v0"}
    return Fabric("LIBFABRIC", env, ("nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"), holder)
