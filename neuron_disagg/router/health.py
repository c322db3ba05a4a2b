"""Health checks and load scraping: every ``health_interval_s`` each instance gets GET /health
(failing ``health_failures_to_eject`` in a row ejects it; one success readmits it), and each
healthy D also GET /metrics, whose vLLM gauges feed the decode choice in ``selection.py``.

``server.py`` runs ``HealthMonitor.run`` for the router's lifetime; the admin endpoint calls
``check`` once on an instance it just added.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .instances import EngineLoad, Instance, InstancePool
from .settings import RouterSettings

logger = logging.getLogger("neuron_disagg.router.health")

# vLLM's gauge names (``gpu_cache_usage_perc`` before vLLM 0.10); all are summed over label sets
# (one per engine with data parallelism). ``*_perc`` is a fraction in 0..1 despite its name.
_RUNNING, _WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def parse_engine_load(text: str, now: float) -> EngineLoad | None:
    """The running/waiting counts and KV usage in a vLLM /metrics page; None if it has neither
    count (not a vLLM instance, or a page we cannot read)."""
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in (_RUNNING, _WAITING) or family.name in _KV_USAGE:
                sums[family.name] = sums.get(family.name, 0.0) + sum(s.value for s in family.samples)
    except ValueError:
        return None
    if _RUNNING not in sums and _WAITING not in sums:
        return None
    usage = next((sums[name] for name in _KV_USAGE if name in sums), None)
    return EngineLoad(sums.get(_RUNNING, 0.0), sums.get(_WAITING, 0.0), usage, now)


class HealthMonitor:
    def __init__(self, pool: InstancePool, session: aiohttp.ClientSession, settings: RouterSettings):
        self.pool, self.session, self.settings = pool, session, settings
        self._timeout = aiohttp.ClientTimeout(total=settings.health_timeout_s,
                                              sock_connect=min(settings.connect_timeout_s,
                                                               settings.health_timeout_s))

    async def run(self) -> None:
        """Waits one interval, then checks every instance; runs until cancelled. The server runs
        one ``check_all`` itself before it takes requests."""
        while True:
            await asyncio.sleep(self.settings.health_interval_s)  # a period, not a wait for a state
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(inst) for inst in self.pool.all()))

    async def check(self, inst: Instance) -> bool:
        """One check of one instance; ejects or readmits it. Returns whether it is healthy now."""
        reason, dead = await self._probe(inst.url + "/health")
        if inst.removed:
            return False
        if reason is None:
            inst.failed_checks = 0
            if self.pool.set_health(inst, True):
                logger.warning("%s %s passed its health check: readmitted", inst.role, inst.url)
            if inst.role == "decode":
                await self._scrape(inst)
            return True
        inst.failed_checks += 1
        if dead or inst.failed_checks >= self.settings.health_failures_to_eject:
            if self.pool.set_health(inst, False):
                logger.warning("%s %s failed %d health check(s) (%s): ejected", inst.role, inst.url,
                               inst.failed_checks, reason)
        return inst.healthy

    async def _probe(self, url: str) -> tuple[str | None, bool]:
        """(None if ``url`` answered 200 else why not, whether nothing is listening at all)."""
        try:
            async with self.session.get(url, timeout=self._timeout) as resp:
                await resp.read()
                return (None if resp.status == 200 else f"HTTP {resp.status}"), False
        except asyncio.TimeoutError:
            return f"no answer within {self.settings.health_timeout_s} s", False
        except aiohttp.ClientConnectorError as exc:  # refused: the process is gone
            return f"{type(exc).__name__}: {exc}", True
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}", False

    async def _scrape(self, inst: Instance) -> None:
        try:
            async with self.session.get(inst.url + "/metrics", timeout=self._timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (asyncio.TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            return  # health decides ejection; a D without usable metrics is chosen by our own counts
        load = parse_engine_load(text, time.monotonic())
        if load is not None:
            inst.engine = load
