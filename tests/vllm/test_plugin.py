"""The `vllm.general_plugins` entry point, loaded the way vLLM loads it, in a fresh interpreter (it
imports vLLM and may patch its CPU platform)."""

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
# The switch, read when vLLM calls the entry point again (it does in each of its processes): one
# interpreter for both, as importing vLLM is most of this module's time.
import os
from neuron_disagg.vllm.plugin import BENCH_KEEP_AFFINITY_ENV, register
os.environ[BENCH_KEEP_AFFINITY_ENV] = "1"
register()
seen["reserved_cores_with_the_switch"] = CpuPlatform.discover_numa_topology()
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def seen() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NEURON_DISAGG_BENCH_KEEP_AFFINITY"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_registers_the_connector_and_leaves_affinity_alone_by_default(seen):
    assert seen["entry_points"] == ["neuron_disagg.vllm.plugin:register"]
    assert seen["connector"] == "neuron_disagg.vllm.connector.NeuronDisaggConnector"
    if os.path.isdir("/sys/devices/system/node/node0"):  # where sysfs shows NUMA nodes
        assert seen["reserved_cores"], "without the switch vLLM's own core reservation is untouched"


def test_benchmark_switch_stops_vllms_nixl_core_reservation(seen):
    assert seen["reserved_cores_with_the_switch"] == []
