"""The `vllm.general_plugins` entry point: vLLM calls ``register`` in every one of its processes
(API server, engine core, workers) before it builds a connector.

It registers ``NeuronDisaggConnector`` with vLLM's connector factory, so a hand-written
--kv-transfer-config may name the connector without ``kv_connector_module_path``.

``BENCH_KEEP_AFFINITY_ENV`` serves the side-by-side benchmark on CPU machines only: vLLM's own NIXL
connector moves each CPU worker to the last core of its NUMA node to keep a core for transfers, so
on a 2-core machine its P and D would both compute on core 1 while ours compute on the cores the
harness gave them. With the variable set, that reservation finds no cores and changes nothing, and
the comparison measures connectors, not core placement.
"""

from __future__ import annotations

import logging
import os

CONNECTOR = "NeuronDisaggConnector"
BENCH_KEEP_AFFINITY_ENV = "NEURON_DISAGG_BENCH_KEEP_AFFINITY"
logger = logging.getLogger(__name__)


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR, "neuron_disagg.vllm.connector", CONNECTOR)
    except ValueError:
        pass  # registered already: vLLM loads general plugins more than once per process
    if os.environ.get(BENCH_KEEP_AFFINITY_ENV) == "1":
        _keep_affinity()


def _keep_affinity() -> None:
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform.discover_numa_topology, "_neuron_disagg_bench", False):
        return

    def no_reserved_cores(cls) -> list[list[int]]:
        return []

    no_reserved_cores._neuron_disagg_bench = True  # type: ignore[attr-defined]
    CpuPlatform.discover_numa_topology = classmethod(no_reserved_cores)  # type: ignore[method-assign]
    logger.info("%s=1: vLLM's NIXL connector keeps the harness's CPU pinning", BENCH_KEEP_AFFINITY_ENV)
