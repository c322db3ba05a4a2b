"""The connector's counters on their way to /metrics: aggregated across workers by vLLM's
``KVConnectorStats`` contract, then exported by ``ConnectorPromMetrics`` through prometheus_client.
The path from the transfer threads into these payloads is exercised by the vLLM integration tests."""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace

import prometheus_client
import pytest

pytest.importorskip("vllm")

from neuron_disagg.vllm.connector import StepClock  # noqa: E402
from neuron_disagg.vllm.stats import COUNTS, ConnectorPromMetrics, ConnectorStats  # noqa: E402


def payload(**counts: int) -> dict:
    return {"counts": counts, "failures": {}, "write_ms": [], "step_us": [], "step_cpu_us": []}


def metric_types() -> tuple[prometheus_client.CollectorRegistry, dict]:
    """A registry of the test's own, and the metric classes vLLM hands ConnectorPromMetrics, bound to it."""
    registry = prometheus_client.CollectorRegistry()
    return registry, {cls: functools.partial(cls, registry=registry)
                      for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)}


def test_worker_snapshots_add_up_across_ranks():
    total = ConnectorStats(payload(bytes=10, agent_resets=1))
    total.aggregate(ConnectorStats(payload(bytes=5, agent_resets=2, descriptors=3)))
    reduced = total.reduce()
    assert (reduced["bytes"], reduced["agent_resets"], reduced["descriptors"]) == (15, 3, 3)
    assert set(COUNTS) <= set(reduced)


def test_every_count_is_exported_as_a_neuron_disagg_counter_per_engine_saying_its_role():
    registry, types = metric_types()
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role="kv_producer"))
    metrics = ConnectorPromMetrics(config, types, ["engine"], {0: ["0"], 1: ["1"]})
    metrics.observe(payload(agent_resets=2, bytes=4096), engine_idx=1)
    metrics.observe(payload(agent_resets=1), engine_idx=1)
    one, zero = {"engine": "1", "role": "prefill"}, {"engine": "0", "role": "prefill"}
    assert registry.get_sample_value("neuron_disagg_agent_resets_total", one) == 3
    assert registry.get_sample_value("neuron_disagg_bytes_total", one) == 4096
    assert registry.get_sample_value("neuron_disagg_agent_resets_total", zero) in (None, 0)
    for name in COUNTS:
        metrics.observe(payload(**{name: 1}), engine_idx=0)
        assert registry.get_sample_value(f"neuron_disagg_{name}_total", zero) == 1, name


def test_held_blocks_is_a_gauge_that_starts_at_zero_and_follows_the_latest_report():
    registry, types = metric_types()
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role="kv_consumer"))
    metrics = ConnectorPromMetrics(config, types, ["engine"], {0: ["0"]})
    labels = {"engine": "0", "role": "decode"}
    assert registry.get_sample_value("neuron_disagg_held_blocks", labels) == 0  # exported from the start
    merged = ConnectorStats({**payload(bytes=1), "held_blocks": 5}).aggregate(ConnectorStats({**payload(), "held_blocks": 2}))
    assert merged.reduce()["held_blocks"] == 2 and not ConnectorStats({**payload(), "held_blocks": 0}).is_empty()
    metrics.observe(merged.data)
    assert registry.get_sample_value("neuron_disagg_held_blocks", labels) == 2
    metrics.observe({**payload(), "held_blocks": 0})
    assert registry.get_sample_value("neuron_disagg_held_blocks", labels) == 0


def test_the_bench_reads_from_metrics_whether_the_step_p99_met_100_us():
    """The steps go through the exported histogram and the bench's reading of its text: a p99 just
    over the design's 100 us aim must not read as within it (the buckets were 100, 500 us)."""
    from neuron_disagg.bench.load import parse_step_time, step_quantile_us
    registry, types = metric_types()
    metrics = ConnectorPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})

    def read():  # what the bench reads from /metrics
        return parse_step_time(prometheus_client.generate_latest(registry).decode())

    start = read()
    metrics.observe({**payload(), "step_us": [20.0] * 97 + [120.0] * 3})
    over = read()
    assert step_quantile_us(start, over, 0.5) == 20.0
    assert 100.0 < step_quantile_us(start, over, 0.99) <= 150.0
    metrics.observe({**payload(), "step_us": [20.0] * 98 + [90.0] * 2})
    assert step_quantile_us(over, read(), 0.99) == 100.0


def test_the_step_clock_tells_the_engine_threads_cpu_from_its_waiting():
    """Wall time counts a hook that waits (for the core, a lock, a sleep); CPU time only what ran."""
    clock = StepClock()
    with clock:
        time.sleep(0.03)
    with clock:  # one step, two hooks: the times add up
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
    wall, cpu = clock.take()
    assert wall >= 0.05 and 0.02 <= cpu < 0.035
    assert clock.take() == (0.0, 0.0)  # the next step starts from nothing


def test_wall_and_cpu_step_times_are_exported_and_read_as_separate_series():
    from neuron_disagg.bench.load import CPU, WALL, parse_step_time, step_quantile_us
    registry, types = metric_types()
    metrics = ConnectorPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    start = {name: parse_step_time("", name) for name in (WALL, CPU)}
    step = ConnectorStats({**payload(), "step_us": [2000.0] * 2 + [20.0] * 98, "step_cpu_us": [15.0] * 97 + [60.0] * 3})
    step.aggregate(ConnectorStats({**payload(), "step_us": [30.0], "step_cpu_us": [25.0]}))  # a second rank
    metrics.observe(step.data)
    text = prometheus_client.generate_latest(registry).decode()
    wall, cpu = parse_step_time(text, WALL), parse_step_time(text, CPU)
    assert wall.steps == cpu.steps == 101
    assert step_quantile_us(start[WALL], wall, 0.99) == 2000.0
    assert step_quantile_us(start[CPU], cpu, 0.99) == 75.0
