"""The `vllm.general_plugins` entry point, loaded the way vLLM loads it, in a fresh interpreter (it
imports vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

pytestmark = pytest.mark.integration  # vLLM's plugin loading in a child process

PROBE = r"""
import json
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()  # vLLM calls it in several places of one process: must be idempotent
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.platforms.cpu import CpuPlatform
cls = KVConnectorFactory._registry["NeuronDisaggConnector"]()
seen = {
    "entry_points": [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "neuron_disagg"],
    "connector": f"{cls.__module__}.{cls.__name__}",
    "reserved_cores": CpuPlatform.discover_numa_topology(),
}
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def seen() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_registers_the_connector(seen):
    assert seen["entry_points"] == ["neuron_disagg.vllm.plugin:register"]
    assert seen["connector"] == "neuron_disagg.vllm.connector.NeuronDisaggConnector"


def test_entry_point_leaves_vllms_own_core_reservation_alone(seen):
    """Only the benchmark's reference instances start without it (``bench/keep_affinity``)."""
    if os.path.isdir("/sys/devices/system/node/node0"):  # where sysfs shows NUMA nodes
        assert seen["reserved_cores"], "vLLM's NIXL worker reserves a core per NUMA node"
