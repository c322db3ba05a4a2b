"""A local Ray cluster serving P and D replicas with our connector (`neuron-disagg ray-serve` from
vLLM 0.29's environment, where Ray Serve LLM 2.60 is installed), and what the tests read of it:
every replica's metrics as Ray exports them, and the replicas' processes."""

from __future__ import annotations

import os
import re

import httpx

from neuron_disagg.local_cluster import RayServeProcess, descendants, ray_serve

from ..vllm_envs import extra_env
from .vllm_cluster import listening, title, wait_for

#: Replicas per role and mode (NEURON_DISAGG_RAY_REPLICAS=2 for a 2P2D run by hand: 8 engines, ~21 GB).
REPLICAS = int(os.environ.get("NEURON_DISAGG_RAY_REPLICAS", "1"))
MODES = ("push", "pull")


class RayCluster:
    def __init__(self, model: str, secret: str, config: dict, replicas: int = REPLICAS):
        self.driver: RayServeProcess = ray_serve(model, secret, config, modes=MODES, replicas=replicas,
                                                  python=extra_env("0.29.0").python)
        self.metrics_port = self.driver.metrics_port

    def app_url(self, mode: str) -> str:
        return self.driver.app_url(mode)

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Every ``neuron_disagg_*`` series and vLLM's KV usage as Ray exports them (``ray_<name>``,
        a ":" made "_", labelled with the replica's ``ReplicaId``): (name, labels, value).

        Ray drops a gauge's series some seconds after its last change (the agent keeps an
        observation two report intervals), so an idle replica's gauges disappear; counters stay."""
        out = []
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        for line in text.splitlines():
            m = re.match(r'^ray_(neuron_disagg_\w+|vllm_kv_cache_usage_perc)\{(.*)\} (\S+)$', line)
            if m:
                out.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))), float(m.group(3))))
        return out

    def total(self, name: str, role: str) -> float:
        """Counter ``name`` summed over the replicas of one role ("prefill" or "decode")."""
        return sum(value for series, labels, value in self.metrics() if series == name and labels.get("role") == role)

    def held_blocks_back(self, timeout_s: float = 60) -> None:
        """Every replica seen holding blocks (our gauge) or KV (vLLM's usage) while this waits is
        seen back at 0: a series that disappears keeps the last value seen, so a replica that went
        idle holding blocks fails this rather than dropping out of it."""
        last: dict[tuple[str, str], float] = {}

        def back() -> bool:
            for name, labels, value in self.metrics():
                if name in ("neuron_disagg_held_blocks", "vllm_kv_cache_usage_perc"):
                    last[(name, labels.get("ReplicaId", ""))] = value
            return bool(last) and not any(last.values())

        try:
            wait_for(back, timeout_s, "every Ray replica's held blocks and KV usage back to 0")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen: {last}") from None

    def listeners(self) -> list[tuple[str, int, str]]:
        """(address, port, process title) of every TCP socket the cluster's processes listen on."""
        return listening(self.driver.process.pid)

    def replica_processes(self, deployment: str) -> list[int]:
        """The worker processes of the replicas of ``deployment`` ("neuron-disagg-push:Prefill", ...):
        Ray names each after its actor, ``ray::ServeReplica:<application>:<deployment>:...``."""
        return [pid for pid, _ in descendants(self.driver.process.pid)
                if title(pid).startswith(f"ray::ServeReplica:{deployment}:")]
