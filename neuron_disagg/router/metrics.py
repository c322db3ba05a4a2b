"""The router's Prometheus series, on a registry of its own (one per router, so tests can run
several in one process). ``app.py`` serves them at /metrics; ``flows.py`` records requests,
latencies, retries and failures; ``InstancePool`` hooks keep the per-instance gauges current."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .instances import Instance

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
        self.decode_imbalance = Histogram(p + "decode_imbalance", "The most running sequences on a healthy D "
                                          "over the mean, as a D leg goes out (1: even)", ["mode"],
                                          buckets=(1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0), registry=r)
        self._children: dict[Instance, tuple[Any, Any, Any]] = {}

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
        try:
            (self.prompt_tokens if inst.role == "prefill" else self.decode_legs).remove(inst.url)
        except KeyError:
            pass
