"""The router's Prometheus series, on a registry of its own (one per router, so tests can run
several in one process). ``app.py`` serves them at /metrics; ``flows.py`` records requests,
latencies, retries and failures; ``InstancePool`` hooks keep the per-instance gauges current."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .instances import Instance

if TYPE_CHECKING:
    from .affinity import Affinity

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      120.0, 300.0, 600.0)


_ERROR_BUCKETS_S = (-10.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, 0.0, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 10.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, "neuron_disagg_router_"
        self.requests = Counter(p + "requests", "Client requests by KV mode and outcome",
                                ["mode", "outcome"], registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "Arrival to first byte sent to a streaming client",
                              ["mode"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram(p + "request_duration_seconds", "Arrival to the last byte sent",
                             ["mode"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.in_flight = Gauge(p + "instance_in_flight", "Legs this router has open on an instance",
                               ["role", "url"], registry=r)
        self.prompt_tokens = Gauge(p + "instance_prompt_tokens",
                                   "Estimated prompt tokens of open P legs", ["url"], registry=r)
        self.healthy = Gauge(p + "instance_healthy", "1 if the instance takes new legs",
                             ["role", "url"], registry=r)
        self.retries = Counter(p + "retries", "P legs retried on another P", ["mode", "reason"],
                               registry=r)
        self.computed_on_decode = Counter(p + "computed_on_decode", "Requests no P could take, sent whole to a D "
                                          "(decode_fallback), by KV mode and why", ["mode", "reason"], registry=r)
        self.failures = Counter(p + "failures", "Failed legs and requests by reason", ["reason"],
                                registry=r)
        self.withdrawals = Counter(p + "withdrawals", "Requests whose KV P was told no decode instance "
                                   "will take (D refused the request or was never sent it)", registry=r)
        self.bind_wait = Histogram(p + "bind_wait_seconds", "Push: P's leg sent -> D chosen and its leg sent "
                                   "(bind_horizon_ms)", ["mode"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.prediction_error = Histogram(p + "prefill_prediction_error_seconds", "P's predicted answer time minus "
                                          "its real one (negative: P answered later than predicted)",
                                          buckets=_ERROR_BUCKETS_S, registry=r)
        self.decode_legs = Counter(p + "decode_legs", "D legs sent, by D, counted as each is bound", ["url"],
                                   registry=r)
        self.prefill_legs = Counter(p + "prefill_legs", "P legs sent, by P", ["url"], registry=r)
        self.decode_imbalance = Histogram(p + "decode_imbalance", "The most running sequences on a healthy D "
                                          "over the mean, as a D leg goes out (1: even)", ["mode"],
                                          buckets=(1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0), registry=r)
        self.affinity_seconds = Histogram(p + "affinity_seconds", "Per request: the prompt's token ids (tokenizing "
                                          "text), their block chain and each instance's hit",
                                          buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1),
                                          registry=r)
        self.prefix_tokens = Counter(p + "prefix_prompt_tokens", "Prompt tokens of legs routed knowing the prompt",
                                     ["role"], registry=r)
        self.prefix_held_tokens = Counter(p + "prefix_held_tokens", "Of those, tokens the chosen instance already "
                                          "held (its KV events or this router's history said)", ["role"], registry=r)
        self._children: dict[Instance, tuple[Any, Any, Any]] = {}

    def watch(self, affinity: Affinity, urls: Callable[[], list[str]]) -> None:
        """Exports what ``affinity`` knows, read at each scrape."""
        self.registry.register(_AffinityCollector(affinity, urls))

    def instance_changed(self, inst: Instance) -> None:
        """Called on every lease change, twice per leg: the labelled children are looked up once."""
        children = self._children.get(inst)
        if children is None:
            children = self._children[inst] = (
                self.in_flight.labels(inst.role, inst.url), self.healthy.labels(inst.role, inst.url),
                self.prompt_tokens.labels(inst.url) if inst.role == "prefill" else None)
        in_flight, healthy, prompt_tokens = children
        in_flight.set(inst.in_flight)
        healthy.set(1 if inst.healthy else 0)
        if prompt_tokens is not None:
            prompt_tokens.set(inst.prompt_tokens)

    def instance_removed(self, inst: Instance) -> None:
        self._children.pop(inst, None)
        for gauge in (self.in_flight, self.healthy):
            try:
                gauge.remove(inst.role, inst.url)
            except KeyError:
                pass
        for series in ((self.prompt_tokens, self.prefill_legs) if inst.role == "prefill" else (self.decode_legs,)):
            try:
                series.remove(inst.url)
            except KeyError:
                pass


class _AffinityCollector(Collector):
    def __init__(self, affinity: Affinity, urls: Callable[[], list[str]]):
        self.affinity, self.urls = affinity, urls

    def collect(self) -> Iterator[Any]:
        from .affinity import SOURCES

        p, a = "neuron_disagg_router_", self.affinity
        source = GaugeMetricFamily(p + "prefix_source", "1 for where the router learns what an instance holds: "
                                   "events (its KV events) or history (what this router sent it)", labels=["url", "source"])
        blocks = GaugeMetricFamily(p + "prefix_indexed_blocks", "Blocks an instance's KV events say it holds",
                                   labels=["url"])
        for url in self.urls():
            for name in SOURCES:
                source.add_metric([url, name], 1.0 if a.source(url) == name else 0.0)
            blocks.add_metric([url], a.index.blocks(url))
        rejected = CounterMetricFamily(p + "kv_events_rejected", "KV event messages or events not applied, by "
                                       "reason", labels=["reason"])
        for reason, n in (a.rejected + a.index.rejected).items():
            rejected.add_metric([reason], n)
        restarts = CounterMetricFamily(p + "kv_events_restarts", "Publishers heard numbering from 0 again (their "
                                       "blocks forgotten)", labels=["url"])
        missed = CounterMetricFamily(p + "kv_events_missed", "Batches skipped in a publisher's sequence",
                                     labels=["url"])
        for family, counts in ((restarts, a.restarts), (missed, a.missed)):
            for url, n in counts.items():
                family.add_metric([url], n)
        yield from (source, blocks, rejected, restarts, missed)
