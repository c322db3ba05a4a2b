"""`neuron-disagg bench` output from given run results: ratios to the reference connector and to
monolithic, the Markdown and JSON files, the plots, and argument checking."""

from __future__ import annotations

import json

import pytest

from neuron_disagg.bench import cli, report
from neuron_disagg.bench.load import (ConnectorReading, RunResult, StepTime, breakdown_between, counter_total,
                                      mean_step_us, step_quantile_us, thread_cpu_percent)
from neuron_disagg.bench.topology import groups
from neuron_disagg.timeline import Timeline


def result(mode, rate, ttft, tpot=10.0, **kw) -> RunResult:
    return RunResult(mode, rate, 512, 32, 8, completed=8, ttft_p50_ms=ttft, ttft_p99_ms=ttft * 2,
                     tpot_p50_ms=tpot, e2el_p50_ms=ttft + 300, **kw)


RESULTS = [result("monolithic", 1.0, 100.0), result("push", 1.0, 150.0, 12.0,
                                                     breakdown_ms={"prefill": 90.0, "write": 5.0, "ttft": 150.0}),
           result("vllm-pull", 1.0, 300.0, 20.0), result("push", 2.0, 180.0),
           result("vllm-push", 1.0, 0.0, error="did not start: boom")]


def test_ratios_are_to_the_reference_connector_and_monolithic_at_the_same_point():
    rows = {(r["mode"], r["rate"]): r for r in report.rows(RESULTS)}
    push = rows[("push", 1.0)]
    assert push["ttft_p50_vs_reference"] == 0.5 and push["tpot_p50_vs_reference"] == 0.6
    assert push["ttft_p50_vs_monolithic"] == 1.5
    assert rows[("push", 2.0)]["ttft_p50_vs_reference"] is None  # no reference run at 2 req/s
    assert rows[("vllm-push", 1.0)]["ttft_p50_vs_reference"] is None  # it did not run


@pytest.mark.slow  # matplotlib renders every plot
def test_files_written(tmp_path):
    written = report.write(RESULTS, {"model": "tiny", "prompts": 8, "output_len": 32, "burstiness": 1.0}, tmp_path)
    names = {p.name for p in written}
    assert {"results.json", "results.md", "latency-in512.png", "ttft-breakdown.png"} <= names
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["runs"]) == len(RESULTS) and data["meta"]["model"] == "tiny"
    md = (tmp_path / "results.md").read_text()
    assert "| push | 1.00 | 512 | 150 | 300 | 12.0 | 0.50 |" in md
    assert "## TTFT breakdown" in md and "did not start: boom" in md
    assert "Idle CPU" not in md  # not measured in this run
    report.write(RESULTS, {"idle_cpu_percent": {"push + pull": {"prefill": 0.9, "decode": 1.14}},
                           "idle_seconds": 10}, tmp_path)
    assert ("Idle CPU (% of one core over 10 s, before any load): push + pull: prefill 0.9%, decode 1.1%"
            in (tmp_path / "results.md").read_text())
    for png in ("latency-in512.png", "ttft-breakdown.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_breakdown_takes_only_the_runs_own_requests(tmp_path):
    t = Timeline(tmp_path, "all")
    base = {"p_arrived": 0.001, "p_scheduled": 0.002, "p_kv_ready": 0.010, "p_registration": 0.003,
            "p_write_posted": 0.012, "d_notified": 0.013, "d_loaded": 0.015, "d_scheduled": 0.016,
            "router_first_byte": 0.020}
    for tid, start in (("inside#0", 100.0), ("inside2#0", 101.0), ("before#0", 90.0)):
        t.mark(tid, "router_arrived", start)
        for event, offset in base.items():
            t.mark(tid, event, start + offset * (3 if tid == "before#0" else 1))
    t.close()
    got = breakdown_between(str(tmp_path), 99.0, 102.0)
    assert got["ttft"] == pytest.approx(20.0) and got["prefill"] == pytest.approx(8.0)
    assert breakdown_between(str(tmp_path), 200.0, 300.0) is None


def test_the_table_shows_step_times_as_p50_p99_pairs_wall_and_cpu():
    runs = [result("monolithic", 1.0, 100.0),
            result("push", 1.0, 150.0, prefill_step_p50_us=10.0, prefill_step_p99_us=2000.0,
                   prefill_step_cpu_p50_us=10.0, prefill_step_cpu_p99_us=75.0)]
    header, mono, push = report.table(runs)
    cell = dict(zip(header, push, strict=True))
    assert (cell["P step p50/p99 us"], cell["P CPU p50/p99 us"], cell["D step p50/p99 us"]) == ("10/2000", "10/75", "-")
    assert dict(zip(header, mono, strict=True))["P CPU p50/p99 us"] == "-"


def test_transfer_threads_cpu_is_read_from_metrics_as_a_share_of_one_core_over_the_run():
    text = ('# HELP neuron_disagg_push_thread_cpu_us_total CPU time of the push thread\n'
            'neuron_disagg_push_thread_cpu_us_total{engine="0",model_name="m"} 1500.0\n'
            'neuron_disagg_push_thread_cpu_us_total{engine="1",model_name="m"} 500.0\n'
            'neuron_disagg_push_thread_cpu_us_created{engine="0",model_name="m"} 1.7e9\n'
            'neuron_disagg_pull_thread_cpu_us_total{engine="0",model_name="m"} 100.0\n')
    assert counter_total(text, "neuron_disagg_push_thread_cpu_us_total") == 2000.0  # not the _created sample
    before = ConnectorReading({}, {"push": 2000.0, "pull": 100.0}, at=10.0)
    after = ConnectorReading({}, {"push": 52000.0, "pull": 100.0}, at=20.0)
    assert thread_cpu_percent("decode", before, after) == {"receiver": 0.5, "reader": 0.0}
    assert thread_cpu_percent("prefill", before, after) == {"writer": 0.5, "lender": 0.0}
    run = result("push", 1.0, 150.0, thread_cpu_percent={"P writer": 0.25, "D receiver": 0.5})
    assert report.thread_line(run).endswith("P writer 0.25, D receiver 0.50")


def test_step_time_difference():
    assert mean_step_us(StepTime(1.0, 100), StepTime(1.002, 104)) == 500.0
    assert mean_step_us(StepTime(1.0, 100), StepTime(1.0, 100)) is None


def test_topologies_group_our_modes_and_run_the_reference_last():
    assert groups(["vllm-pull", "push", "monolithic", "pull"]) == [("monolithic",), ("push", "pull"), ("vllm-pull",)]


def test_the_ray_modes_share_one_ray_cluster_and_are_asked_for_by_name():
    assert groups(["ray-pull", "push", "ray-push"]) == [("push",), ("ray-push", "ray-pull")]
    assert "ray-push" not in cli.parse([]).modes and cli.parse(["--modes", "push,ray-push"]).modes == ["push", "ray-push"]


def test_the_ray_modes_refuse_vllm_flags_they_cannot_pass_on():
    from neuron_disagg.bench.topology import ServerSettings, _build

    with pytest.raises(RuntimeError, match="pass no other vLLM flags"):
        _build(("ray-push",), ServerSettings("m", extra=("--no-enable-prefix-caching", "--tensor-parallel-size", "8")))


@pytest.mark.parametrize("argv, words", [
    (["--modes", "push,teleport"], "unknown mode"),
    (["--rates", "1,x"], "comma-separated"),
    (["--rates", "0"], "positive"),
    (["--input-lens", "4000", "--max-model-len", "2048"], "shorter than the longest input"),
])
def test_bad_arguments_fail_before_anything_starts(argv, words, capsys, monkeypatch):
    monkeypatch.setattr("neuron_disagg.bench.cli.started", lambda *a, **k: pytest.fail("started something"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv + ["--model", "/nonexistent-model"])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_step_quantiles_come_from_the_histogram_buckets_between_two_readings():
    before = StepTime(0.0, 100, {1e-05: 90, 0.0001: 100, 0.0005: 100, float("inf"): 100})
    after = StepTime(0.1, 300, {1e-05: 190, 0.0001: 296, 0.0005: 298, float("inf"): 300})
    assert step_quantile_us(before, after, 0.5) == 10.0      # 100 of the 200 new steps took <= 10 us
    assert step_quantile_us(before, after, 0.99) == 500.0    # 196 <= 100 us is short of 198
    assert step_quantile_us(before, before, 0.5) is None


def test_drift_compares_monolithic_at_the_runs_start_and_end_point_by_point(tmp_path):
    again = [result("monolithic", 1.0, 110.0, 9.0), result("monolithic", 2.0, 0.0, error="did not start: boom")]
    drift = report.drift(RESULTS, again)
    assert drift[0]["ttft_p50_ms"] == [100.0, 110.0] and drift[0]["ttft_p50_ratio"] == 1.1
    assert drift[0]["tpot_p50_ratio"] == 0.9
    assert len(drift) == 1  # RESULTS measured monolithic at 1 req/s only: nothing to compare at 2
    line = report.drift_line(drift + [{**drift[0], "rate": 4.0, "error": "did not start: boom"}])
    assert "1.0 req/s in 512: TTFT p50 100 -> 110 ms (1.10x), TPOT p50 10.0 -> 9.0 ms (0.90x)" in line
    assert "4.0 req/s in 512: not measured again (did not start: boom)" in line
    report.write(RESULTS, {"drift": drift}, tmp_path)
    assert report.drift_line(drift) in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["drift"] == drift
