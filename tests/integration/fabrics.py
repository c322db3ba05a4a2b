"""The NIXL backends the cross-process transfer tests run over: UCX on loopback, and LIBFABRIC —
the EFA backend of trn2 and p5en — through libfabric's tcp provider; and the NIXL releases they run
on (``NIXL_RELEASES``): 1.4.1 and 1.5.0 over both, 1.5.1 over UCX. 1.5.1's LIBFABRIC plugin needs a
libfabric exporting ``FABRIC_1.10`` (2.7.0), which no index here has (docs/verified.md).

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


@dataclass(frozen=True)
class NixlRelease:
    version: str
    venv: str | None  # None: ./.venv, the test runner's own
    backends: tuple[str, ...]
    extended: bool = False  # only in the extended tier (scripts/extended.sh builds its environment)

    @property
    def python(self) -> str:
        """The environment's interpreter; a missing one fails the test that needs it, saying how to
        build it."""
        if self.venv is None:
            return sys.executable
        python = REPO / self.venv / "bin" / "python"
        if not python.exists():
            raise RuntimeError(f"no NIXL {self.version} environment at {python.parent.parent}: run "
                               f"`bash scripts/{'extended' if self.extended else 'setup'}.sh`")
        return str(python)


#: 1.4.1: ./.venv's, and the Neuron plugin's vLLM 0.29's. 1.5.0: what `neuron-disagg[cuda]` installs
#: beside vLLM 0.33 and 0.34 (which refuse older), in their environment (scripts/vllm_env.sh).
#: 1.5.1: the newest these indexes have (scripts/nixl_env.sh), in the extended tier: its Python and
#: UCX path are 1.5.0's, and CI's 30 minutes are short.
NIXL_RELEASES = (NixlRelease("1.4.1", None, ("UCX", "LIBFABRIC")),
                 NixlRelease("1.5.0", ".venv-vllm-0.34.0", ("UCX", "LIBFABRIC")),
                 NixlRelease("1.5.1", ".venv-nixl-1.5.1", ("UCX",), extended=True))
NEWEST_NIXL = NIXL_RELEASES[-1]
NAMESPACE_SETUP = ("ip link set lo up && ip link add v0 type veth peer name v1 && "
                   "ip addr add 198.18.0.1/24 dev v0 && ip link set v0 up && ip link set v1 up && "
                   "touch {ready} && exec sleep 1000000")


@dataclass
class Fabric:
    backend: str
    env: dict = field(default_factory=dict)
    prefix: tuple[str, ...] = ()
    holder: subprocess.Popen | None = None
    python: str = sys.executable  # the interpreter of the environment whose NIXL the peers load
    nixl: str | None = None  # the NIXL version they must report, where the test names one

    def peer(self, role: str, *args: str) -> PeerProcess:
        proc = PeerProcess(role, "--backend", self.backend, *args, env=self.env, prefix=self.prefix,
                           python=self.python)
        if self.nixl is not None and proc.nixl != self.nixl:
            proc.kill()
            raise RuntimeError(f"a peer of {self.python} loaded NIXL {proc.nixl}, not {self.nixl}: "
                               "rebuild that environment (`bash scripts/setup.sh`)")
        return proc

    def send(self, address: str, secret: bytes, message) -> None:
        """Sends one signed message to a side channel the way any host on the peers' network could
        (from inside their namespace when they have one)."""
        from neuron_disagg.protocol import WireCodec

        frame = WireCodec(secret).encode(message)
        sender = ("import socket, sys, time; from neuron_disagg.transfer.side_channel import write_frame; "
                  "host, port = sys.argv[1].rsplit(':', 1); s = socket.create_connection((host, int(port))); "
                  "write_frame(s, sys.stdin.buffer.read()); time.sleep(0.2); s.close()")
        subprocess.run([*self.prefix, self.python, "-c", sender, address], input=frame, check=True, timeout=30)

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


def ucx(release: NixlRelease | None = None) -> Fabric:
    """``release``: the peers run in its environment, and must load it; None: this interpreter's NIXL."""
    if release is None:
        return Fabric("UCX")
    return Fabric("UCX", python=release.python, nixl=release.version)


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


def libfabric(tmp: Path, release: NixlRelease | None = None) -> Fabric:
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
    made = Fabric("LIBFABRIC", env, ("nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"), holder)
    if release is not None:
        made.python, made.nixl = release.python, release.version
    return made
