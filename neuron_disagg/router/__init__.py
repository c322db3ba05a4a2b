"""Push-aware OpenAI-compatible router: one entry point for clients, many prefill (P) and decode
(D) vLLM instances behind it.

``neuron-disagg router ...`` (``cli.py``) builds a ``RouterSettings`` and an ``InstancePool`` and
starts ``server.start_router``; tests call ``start_router`` directly. A request flows
``app.py`` (HTTP, auth, validation) -> ``flows.py`` (push or pull orchestration, retries) ->
``upstream.py`` (one upstream HTTP call each). ``selection.py`` picks instances by load,
``health.py`` ejects and readmits them, ``metrics.py`` holds the Prometheus series.
"""

from .errors import RouterError
from .instances import Instance, InstanceSpecError, parse_instance_spec
from .pool import InstancePool
from .server import RunningRouter, start_router
from .settings import RouterSettings

__all__ = [
    "Instance", "InstancePool", "InstanceSpecError", "RouterError", "RouterSettings", "RunningRouter",
    "parse_instance_spec", "start_router",
]
