"""The benchmark's own start-up patch for the reference instances it starts (vLLM's own NIXL
connectors, ``local_cluster.reference``), on CPU machines only.

vLLM's NIXL connector moves each CPU worker to the last core of its NUMA node, to keep that core
for transfers (``CpuPlatform.discover_numa_topology``): on a 2-core machine its P and D would both
compute on core 1, while ours compute on the cores the harness gave them. ``server_env`` puts this
directory first on a reference instance's PYTHONPATH, so every Python process of that instance (API
server, engine core, workers) starts with its ``sitecustomize``, which makes that reservation find
no cores: the comparison then measures connectors, not core placement. Nothing of the product
loads it; vLLM processes started any other way keep vLLM's own behaviour.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The directory whose ``sitecustomize`` a process finds first when this is first on its PYTHONPATH.
SITE_DIR = str(Path(__file__).resolve().parent)


def server_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a reference instance's environment adds: this directory first on PYTHONPATH, ahead of
    what the environment had there (vLLM still loads plugins, ours included, from it)."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (SITE_DIR, environ.get("PYTHONPATH", "")) if p)}
