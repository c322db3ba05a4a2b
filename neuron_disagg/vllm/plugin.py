"""The `vllm.general_plugins` entry point: vLLM calls ``register`` in every one of its processes
(API server, engine core, workers) before it builds a connector.

It registers ``NeuronDisaggConnector`` with vLLM's connector factory, so a hand-written
--kv-transfer-config may name the connector without ``kv_connector_module_path``.
"""

from __future__ import annotations

CONNECTOR = "NeuronDisaggConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR, "neuron_disagg.vllm.connector", CONNECTOR)
    except ValueError:
        pass  # registered already: vLLM loads general plugins more than once per process
