"""Connector metrics through vLLM's own stats pipeline: workers snapshot their counters each step
(``get_kv_connector_stats``), vLLM aggregates them across workers and intervals, and the API
server exports them on vLLM's ``/metrics`` as ``neuron_disagg_*``.

The payload is a plain dict (vLLM sends it between processes):
``{"counts": {name: int}, "failures": {reason: int}, "write_ms": [...], "step_us": [...],
"step_cpu_us": [...], "failed_requests": {router transfer id: reason}}`` (the step lists: each
step's time in our hooks, wall clock and engine-thread CPU, ``connector.StepClock``; the last for
``failures.py``), and
from the scheduler side ``"held_blocks": int`` when the blocks it holds for transfers changed (a
gauge, so a leak shows on /metrics as a value that does not come back to 0) and its own counts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .failures import remember

COUNTS = {
    "transfers": "KV transfers completed (P: writes done; D: loads finished)",
    "transfers_failed": "KV transfers that ended without delivering KV",
    "bytes": "KV bytes posted for transfer",
    "descriptors": "transfer descriptors posted, after merging",
    "registrations_rejected": "registrations refused before any write (bad geometry, memory)",
    "messages_rejected": "wire messages refused (signature, version, size, schema)",
    "params_rejected": "requests whose kv_transfer_params were unsigned, forged, expired or malformed "
                       "(served as plain requests)",
    "params_replayed": "requests whose signed kv_transfer_params another request had already used (served as "
                       "plain requests): params are good for the prompts of one HTTP request",
    "params_for_other_role": "requests whose signed kv_transfer_params were for the other role (a router "
                             "with P and D swapped; served as plain requests)",
    "early_hand_offs": "P prefills handed to the writer when their last forward ended, a step before the "
                       "request's end",
    "connector_bugs": "scheduler-side events no state table allows, or early hand-offs whose blocks differ "
                      "from vLLM's (each logged as an error; stays 0)",
    "chunks_streamed": "P: prefill steps whose finished blocks went to the writer as the prefill ran (streaming)",
    "chunk_writes": "P: writes of finished chunks posted while the prefill ran (one in flight per transfer; "
                    "what finishes meanwhile goes merged in the next)",
    "layer_parts": "P: parts of chunk writes (one per group of layers and D rank) that waited for the "
                   "running forward to write their layers (stream: layers), each posted once it had",
    "layer_groups_hooked": "P: groups of layers fenced as the forward wrote them (vLLM's save_kv_layer; "
                           "stream: layers)",
    "layer_groups_at_step_end": "P: groups of layers the per-layer hook never reached, fenced at the "
                                "step's end instead (stays 0 where vLLM calls the hook on every layer)",
    "streams_rewritten": "P: streamed transfers written again from their start, the prefill having been "
                         "preempted (its blocks freed, maybe under a write) and computed again",
    "writes_planned_ahead": "P writes planned while the prefill's last forward ran, so that the write waited "
                            "for no plan (of transfers; the rest: D registered after that forward)",
    "writes_prepared_ahead": "P WRITEs (one per D rank) whose NIXL request was built while the prefill's last "
                             "forward ran, so that after it the write was only posted",
    "landings_awaited": "D: loads seen landing by a step that runs no forward, which waited for them (up to "
                        "landing_wait_s) so that it, not the next step, reported them",
    "landing_wait_us": "D: time the engine loop spent in those waits, microseconds (steps that compute nothing; "
                       "not in neuron_disagg_connector_step_seconds)",
    "lease_expiries": "P leases that expired: push with no registration or heartbeat, pull with no read",
    "quarantines": "D: loads given up on because P was gone (refused or unanswered probes, a restart): the request "
                   "went on at once while the blocks P may still write into waited for their fence",
    "landed_in_quarantine": "D: P's writes (or D's reads) that landed in blocks already quarantined; never decoded",
    "blocks_quarantined": "D: blocks kept out of vLLM's pool in quarantine, summed over quarantines",
    "quarantined_block_seconds": "D: blocks kept in quarantine times the seconds each was kept (divide by "
                                 "neuron_disagg_quarantines_total for the cost of one)",
    "agent_resets": "initiator NIXL agents replaced after a failed transfer (LIBFABRIC: a dead peer poisons the old one)",
    "push_thread_cpu_us": "CPU time of the push thread (P: the writer; D: the receiver), microseconds",
    "pull_thread_cpu_us": "CPU time of the pull thread (P: the lender; D: the reader), microseconds",
}


def empty() -> dict[str, Any]:
    return {"counts": {}, "failures": {}, "recomputed": {}, "write_ms": [], "step_us": [], "step_cpu_us": [],
            "failed_requests": {}}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


class Deltas:
    """A worker's counters are cumulative; vLLM adds up what each step reports. This turns the
    totals into what changed since the previous snapshot, in the payload above."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._writes = 0

    def payload(self, totals: Counter, failures: Counter, write_seconds: list[float], step_us: list[float],
                step_cpu_us: list[float], failed_requests: dict[str, str], recompute: bool) -> dict[str, Any] | None:
        """None when nothing changed. ``recompute``: D under kv_load_failure_policy recompute, where
        every failed load went back to vLLM to compute (counted as recomputed, by reason)."""
        counts = {k: v - self._counts[k] for k, v in totals.items() if v - self._counts[k]}
        new_failures = {k: v - self._failures[k] for k, v in failures.items() if v - self._failures[k]}
        write_ms = [s * 1e3 for s in write_seconds[self._writes:]]
        self._counts, self._failures, self._writes = Counter(totals), Counter(failures), len(write_seconds)
        if not (counts or new_failures or write_ms or step_us or failed_requests):
            return None
        return {"counts": counts, "failures": new_failures, "recomputed": new_failures if recompute else {},
                "write_ms": write_ms, "step_us": step_us, "step_cpu_us": step_cpu_us,
                "failed_requests": failed_requests}


class ConnectorStats(KVConnectorStats):
    def __init__(self, data: dict[str, Any] | None = None):
        super().__init__(data=data or empty())

    def reset(self) -> None:
        self.data = empty()

    def is_empty(self) -> bool:
        d = self.data
        return not (any(d["counts"].values()) or d["failures"] or d.get("recomputed") or d["write_ms"]
                    or d["step_us"] or "held_blocks" in d or "quarantined_blocks" in d or d.get("failed_requests"))

    def aggregate(self, other: KVConnectorStats) -> ConnectorStats:
        mine, theirs = self.data, other.data
        mine["counts"] = dict(Counter(mine["counts"]) + Counter(theirs.get("counts", {})))
        mine["failures"] = dict(Counter(mine["failures"]) + Counter(theirs.get("failures", {})))
        mine["recomputed"] = dict(Counter(mine.get("recomputed", {})) + Counter(theirs.get("recomputed", {})))
        mine["write_ms"] = mine["write_ms"] + list(theirs.get("write_ms", []))
        for series in ("step_us", "step_cpu_us"):
            mine[series] = mine.get(series, []) + list(theirs.get(series, []))
        mine["failed_requests"] = {**mine.get("failed_requests", {}), **theirs.get("failed_requests", {})}
        for gauge in ("held_blocks", "quarantined_blocks"):  # the latest value wins
            if gauge in theirs:
                mine[gauge] = theirs[gauge]
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {name: d["counts"].get(name, 0) for name in COUNTS}
        out["write_ms_p50"] = round(_median(d["write_ms"]), 3)
        out["connector_us_per_step_p50"] = round(_median(d["step_us"]), 1)
        out["connector_cpu_us_per_step_p50"] = round(_median(d.get("step_cpu_us", [])), 1)
        out["recomputed"] = sum(d.get("recomputed", {}).values())
        for gauge in ("held_blocks", "quarantined_blocks"):
            if gauge in d:
                out[gauge] = d[gauge]
        return out


# Fine around the design's 100 us aim (I5), so that the bench's p99, read as a bucket bound, says
# whether a step met it and by how much.
STEP_BUCKETS_S = [5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2e-3, 5e-3,
                  1e-2, 5e-2]


class ConnectorPromMetrics(KVConnectorPromMetrics):
    """``neuron_disagg_*`` counters and histograms, one series per vLLM engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        role = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", None) or "unknown"
        self._role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(role, role)
        # Every series says its role: where one scrape covers P and D (Ray exports every replica's
        # metrics from one port; a Kubernetes Prometheus scrapes both pods' alike), it tells them apart.
        labelnames = [*labelnames, "role"]
        self._counts = {name: self._counter_cls(f"neuron_disagg_{name}", doc, labelnames=labelnames)
                        for name, doc in COUNTS.items()}
        self._failures = self._counter_cls("neuron_disagg_failures", "failed transfers by reason",
                                           labelnames=[*labelnames, "reason"])
        self._recomputed = self._counter_cls(
            "neuron_disagg_recomputed", "D: requests whose KV did not arrive and that D computed itself, by reason "
            "(kv_load_failure_policy: recompute)", labelnames=[*labelnames, "reason"])
        self._write = self._histogram_cls(
            "neuron_disagg_write_seconds", "P: submit to every WRITE complete", labelnames=labelnames,
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5])
        self._step = self._histogram_cls(
            "neuron_disagg_connector_step_seconds", "time the connector spends on the engine loop per step",
            labelnames=labelnames, buckets=STEP_BUCKETS_S)
        self._step_cpu = self._histogram_cls(
            "neuron_disagg_connector_step_cpu_seconds", "the engine thread's CPU time in the connector per "
            "step (the wall-clock series less the time the thread waited, for a lock or for its core)",
            labelnames=labelnames, buckets=STEP_BUCKETS_S)
        self._held = self._gauge_cls(
            "neuron_disagg_held_blocks", "KV blocks the connector holds for transfers (P: handed to the "
            "writer; D: registered for P's write, or fenced); back to 0 when nothing is in flight",
            labelnames=labelnames, multiprocess_mode="mostrecent")
        self._quarantined = self._gauge_cls(
            "neuron_disagg_quarantined_blocks", "D: KV blocks kept out of vLLM's pool because a P that is gone "
            "may still write into them; back to 0 once their fences pass", labelnames=labelnames,
            multiprocess_mode="mostrecent")
        # What the router checks each instance against (router/health.py): 1 for the role it runs.
        self._role_gauge = self._gauge_cls(
            "neuron_disagg_role", "the role this instance's connector runs (1): prefill or decode",
            labelnames=labelnames, multiprocess_mode="mostrecent")
        for labels in per_engine_labelvalues.values():
            self._held.labels(*labels, self._role).set(0)
            self._quarantined.labels(*labels, self._role).set(0)
            self._role_gauge.labels(*labels, self._role).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.get("counts", {}).items():
            if name in self._counts and value:
                self._counts[name].labels(*labels, self._role).inc(value)
        for reason, value in transfer_stats_data.get("failures", {}).items():
            self._failures.labels(*labels, self._role, reason).inc(value)
        for reason, value in transfer_stats_data.get("recomputed", {}).items():
            self._recomputed.labels(*labels, self._role, reason).inc(value)
        for ms in transfer_stats_data.get("write_ms", []):
            self._write.labels(*labels, self._role).observe(ms / 1e3)
        for series, histogram in (("step_us", self._step), ("step_cpu_us", self._step_cpu)):
            for us in transfer_stats_data.get(series, []):
                histogram.labels(*labels, self._role).observe(us / 1e6)
        if "held_blocks" in transfer_stats_data:
            self._held.labels(*labels, self._role).set(transfer_stats_data["held_blocks"])
        if "quarantined_blocks" in transfer_stats_data:
            self._quarantined.labels(*labels, self._role).set(transfer_stats_data["quarantined_blocks"])
        remember(transfer_stats_data.get("failed_requests") or {})
