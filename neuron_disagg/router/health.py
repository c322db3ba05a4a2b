"""Health checks, role checks and load scraping: every ``health_interval_s`` each instance gets
GET /health (failing ``health_failures_to_eject`` in a row ejects it; one success readmits it) and
GET /metrics, where our connector says which role the instance runs (``neuron_disagg_role``) and
vLLM's gauges feed the decode choice in ``selection.py``.

An instance whose connector runs the other role than the router was told (addresses swapped, a
mistyped port) would serve every leg sent to it as a plain request: it is ejected at once, naming
both roles, and the router refuses to start with one (``RoleMismatch``). Instances that export no
role (vLLM's own connectors, in modes vllm-push and vllm-pull) are not checked.

``server.py`` runs ``HealthMonitor.run`` for the router's lifetime; the admin endpoint calls
``check`` once on an instance it just added.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .instances import EngineLoad, Instance
from .pool import InstancePool
from .settings import RouterSettings

logger = logging.getLogger("neuron_disagg.router.health")

# vLLM's gauge names (``gpu_cache_usage_perc`` before vLLM 0.10); all are summed over label sets
# (one per engine with data parallelism). ``*_perc`` is a fraction in 0..1 despite its name.
_RUNNING, _WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_ROLE = "neuron_disagg_role"  # our connector's: 1 for the role it runs (vllm/stats.py)


class RoleMismatch(RuntimeError):
    """Instances run the other role than the router was told; the message names each."""


def parse_roles(text: str) -> set[str]:
    """The roles a /metrics page says its connector runs (none: not our connector, or unreadable)."""
    try:
        return {s.labels.get("role", "") for family in text_string_to_metric_families(text)
                if family.name == _ROLE for s in family.samples if s.value == 1}
    except ValueError:
        return set()


def role_mismatch(inst: Instance, roles: set[str]) -> str | None:
    """Why ``inst`` cannot serve its role, or None (its connector runs it, or says nothing)."""
    if not roles or inst.role in roles:
        return None
    runs = " and ".join(sorted(roles))
    return (f"{inst.url} was given as {inst.role} (--{inst.role}), but its connector runs as {runs}: "
            "are the --prefill and --decode addresses swapped?")


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
        self.check_roles = settings.mode in ("push", "pull")  # our connector's modes
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
        if inst.unanswered_since is None:
            inst.unanswered_since = time.monotonic()
        reason, heard = await self._probe(inst.url + "/health")
        if heard != "nothing":
            inst.unanswered_since = None  # it answered, or refused: either way not silent
        dead = heard == "refused"
        if reason is None and (self.check_roles or inst.role == "decode"):
            reason = await self._scrape(inst)
            dead = reason is not None  # the wrong role: out at once, whatever its health
        if inst.removed:
            return False
        if reason is None:
            inst.failed_checks = 0
            if self.pool.set_health(inst, True):
                logger.warning("%s %s passed its health check: readmitted", inst.role, inst.url)
            return True
        inst.failed_checks += 1
        if dead or inst.failed_checks >= self.settings.health_failures_to_eject:
            if self.pool.set_health(inst, False):
                logger.warning("%s %s failed %d health check(s) (%s): ejected", inst.role, inst.url,
                               inst.failed_checks, reason)
        return inst.healthy

    async def _probe(self, url: str) -> tuple[str | None, str]:
        """(None if ``url`` answered 200 else why not, what was heard: "answer", "refused" (nothing
        is listening: the process is gone) or "nothing" (no answer in time: stopped, hung or slow))."""
        try:
            async with self.session.get(url, timeout=self._timeout) as resp:
                await resp.read()
                return (None if resp.status == 200 else f"HTTP {resp.status}"), "answer"
        except asyncio.TimeoutError:
            return f"no answer within {self.settings.health_timeout_s} s", "nothing"
        except aiohttp.ClientConnectorError as exc:
            return f"{type(exc).__name__}: {exc}", "refused"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}", "answer"

    async def _scrape(self, inst: Instance) -> str | None:
        """Reads the instance's /metrics: its role (when we check roles) and, for a D, its load.
        Returns why it cannot serve its role, or None."""
        try:
            async with self.session.get(inst.url + "/metrics", timeout=self._timeout) as resp:
                if resp.status != 200:
                    return inst.role_mismatch
                text = await resp.text()
        except (asyncio.TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            # health decides ejection; a D without usable metrics is chosen by our own counts; a
            # role seen wrong stays so until a page says otherwise
            return inst.role_mismatch
        if self.check_roles:
            inst.role_mismatch = role_mismatch(inst, parse_roles(text))
        if inst.role == "decode":
            load = parse_engine_load(text, time.monotonic())
            if load is not None:
                inst.engine = load
        return inst.role_mismatch
