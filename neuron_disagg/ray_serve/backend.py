"""Our connector as a Ray Serve LLM KV-connector backend: how Ray's P/D orchestrator shapes the two
legs of a request for it, and what each replica publishes.

Ray creates one backend per replica (P and D alike) when the replica's engine starts and calls
``setup`` before vLLM reads ``kv_transfer_config``. The decode replica's orchestrator
(``decode_server.NeuronDisaggDecodeServer``) then calls ``prepare_prefill_request`` and
``prepare_decode_request`` for every request; with ``requires_peer_binding`` it first picks the P
replica and hands us that replica's ``replica_metadata`` as ``peer``.

- push: peer-bound and concurrent. D's leg names the chosen P's side channel, so D registers its
  blocks while P computes, as under our router.
- pull: sequential. P's answers carry its signed offers; D's leg carries them (one P leg per
  distinct prompt: ``prefill_legs``).

Both legs carry params signed here under the deployment secret, which the replica reads from its
own environment or file (``Config.load_secret``), never from Ray's config. Imported only where
Ray is installed.
"""

from __future__ import annotations

import uuid
from typing import Any

import ray
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import BaseConnectorBackend

from .. import kv_params
from ..config import Config
from . import leg_shaping

#: D's replicas listen this far above the configured side-channel port, P's at it (each replica then
#: adds its rank times its ranks per replica): P and D replicas may share a node.
DECODE_PORT_SHIFT = 500


class NeuronDisaggBackend(BaseConnectorBackend):
    """Registered with Ray under the connector's name (``app.register``). The mode comes from our
    config in ``kv_connector_extra_config``; it sets which of Ray's hand-off quadrants we are in."""

    def __init__(self, llm_config):
        super().__init__(llm_config)
        extra = self.kv_transfer_config.setdefault("kv_connector_extra_config", {})
        self.config = Config.from_mapping(extra, source="kv_connector_extra_config")
        self.requires_peer_binding = self.concurrent_handoff = self.config.mode == "push"
        self._signer: kv_params.ParamsSigner | None = None
        self._side_channel = self.config.side_channel

    # -- every replica, at engine start ----------------------------------------------------------------
    def setup(self) -> None:
        """Gives this replica's vLLM a side channel of its own: the node's address unless the config
        names one, and a port no other replica on the node uses. Checks the secret now, not on the
        first request."""
        self._signer = self.config.params_signer()
        extra = self.kv_transfer_config["kv_connector_extra_config"]
        host = extra.get("side_channel_host") or ray.util.get_node_ip_address()
        shift = DECODE_PORT_SHIFT if self.kv_transfer_config.get("kv_role") == "kv_consumer" else 0
        port = self.config.side_channel_port + shift + self._compute_port_offset()
        extra.update(side_channel_host=host, side_channel_port=port)
        # One engine id per replica: the config Ray copies to every replica of a deployment carries one.
        self.kv_transfer_config["engine_id"] = f"{self.kv_transfer_config.get('kv_role', 'kv')}-{uuid.uuid4().hex[:12]}"
        self._side_channel = f"{host}:{port}"

    def replica_metadata(self) -> dict[str, Any]:
        """What D's orchestrator learns of the P replica it picked (push: where D registers)."""
        return leg_shaping.peer_metadata(self._side_channel, self._tp())

    # -- D's orchestrator, per request -----------------------------------------------------------------
    def prepare_prefill_request(self, *, request, peer: dict[str, Any] | None):
        return self.prefill_legs(request)[0]

    def prefill_legs(self, request) -> list:
        """P's legs (``leg_shaping.prefill_legs``): under pull, one per distinct prompt."""
        return leg_shaping.prefill_legs(request, self.config.mode, self.signer)

    def prepare_decode_request(self, *, request, peer: dict[str, Any] | None, prefill_response: Any):
        """``prefill_response``: None (push), P's answer, or under pull a list of them, one per leg
        of ``prefill_legs``."""
        answers = prefill_response if isinstance(prefill_response, list) else [prefill_response]
        return leg_shaping.decode_leg(request, self.config.mode, self.signer, peer=peer, answers=answers)

    @property
    def signer(self) -> kv_params.ParamsSigner:
        if self._signer is None:  # Ray calls setup() first; a backend made outside a replica may not
            self._signer = self.config.params_signer()
        return self._signer

    def _tp(self) -> int:
        return int(self.llm_config.engine_kwargs.get("tensor_parallel_size") or 1)
