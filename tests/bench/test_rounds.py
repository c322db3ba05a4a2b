"""`neuron-disagg bench --rounds N`: the order in which topologies are paused, resumed and measured,
and the median over rounds. The real topologies run in tests/integration/test_bench.py; here
``started`` yields topologies whose instances only record the signals they are sent."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from neuron_disagg.bench import report, rounds
from neuron_disagg.bench.load import RunResult
from neuron_disagg.bench.topology import Running


class RecordingInstance:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def pause(self):
        self.log.append(("pause", self.name))

    def resume(self):
        self.log.append(("resume", self.name))


def fake_started(log, fail=()):
    @contextmanager
    def started(group, server, idle_window_s=0):
        if group in fail:
            raise RuntimeError(f"{group[0]} exited")
        name = "+".join(group)
        log.append(("start", name))
        yield Running({m: f"http://{m}" for m in group}, [RecordingInstance(name, log)])
        log.append(("stop", name))
    return started


def run_rounds(monkeypatch, groups, n, fail=()):
    log = []
    monkeypatch.setattr(rounds, "started", fake_started(log, fail))
    ttft = iter(range(100, 1000, 10))

    def measure(group, topology, round_index):
        log.append(("measure", "+".join(group), round_index))
        return [RunResult(m, 1.0, 512, 8, 4, completed=4, ttft_p50_ms=float(next(ttft))) for m in group]

    def start_failed(group, exc):
        return [RunResult(m, 1.0, 512, 8, 4, error=f"did not start: {exc}") for m in group]

    return rounds.measure_in_rounds(groups, None, n, measure, start_failed), log


def test_every_topology_starts_once_and_only_the_measured_one_runs(monkeypatch):
    results, log = run_rounds(monkeypatch, [("monolithic",), ("push", "pull"), ("vllm-pull",)], 2)
    running = set()
    for entry in log:
        kind, name = entry[0], entry[1]
        if kind in ("start", "resume"):
            running.add(name)
        elif kind == "pause":
            running.discard(name)
        elif kind == "measure":
            assert running == {name}, f"{name} measured while {running} ran"
    measured = [(e[1], e[2]) for e in log if e[0] == "measure"]
    assert measured == [("monolithic", 0), ("push+pull", 0), ("vllm-pull", 0),
                        ("monolithic", 1), ("push+pull", 1), ("vllm-pull", 1)]
    assert [e for e in log if e[0] == "start"] == [("start", n) for n in ("monolithic", "push+pull", "vllm-pull")]
    stops = [i for i, e in enumerate(log) if e[0] == "stop"]
    for name in ("monolithic", "push+pull", "vllm-pull"):  # resumed before stopped: SIGTERM reaches it
        last_signal = max(i for i, e in enumerate(log) if e[0] in ("pause", "resume") and e[1] == name)
        assert log[last_signal][0] == "resume" and last_signal < min(stops)
    assert [r.mode for r in results] == ["monolithic", "push", "pull", "vllm-pull"]


def test_each_point_is_the_median_over_rounds_and_keeps_every_rounds_p50(monkeypatch):
    results, _ = run_rounds(monkeypatch, [("monolithic",), ("push",)], 3)
    push = next(r for r in results if r.mode == "push")
    assert push.rounds_ttft_p50_ms == [110.0, 130.0, 150.0] and push.ttft_p50_ms == 130.0
    assert (push.completed, push.prompts) == (12, 12)
    row = next(r for r in report.rows(results) if r["mode"] == "push")
    assert row["ttft_p50_spread"] == "110-150" and row["ttft_p50_vs_monolithic"] == round(130 / 120, 2)
    header, *_ = report.table(results)
    assert "rounds' p50 ms" in header and "interleaved rounds" in report.markdown(results, {"rounds": 3})
    assert "rounds' p50 ms" not in report.table([RunResult("push", 1.0, 512, 8, 4, ttft_p50_ms=1.0)])[0]


def test_a_topology_that_does_not_start_is_reported_and_the_rest_still_run(monkeypatch):
    results, log = run_rounds(monkeypatch, [("monolithic",), ("push",)], 2, fail=[("monolithic",)])
    assert [(r.mode, r.error) for r in results] == [("push", None), ("monolithic", "did not start: monolithic exited")]
    assert [e[2] for e in log if e[0] == "measure"] == [0, 1]


def test_medians_of_dicts_and_missing_figures():
    a = RunResult("push", 1.0, 512, 8, 4, completed=4, ttft_p50_ms=10.0, breakdown_ms={"write": 1.0, "ttft": 10.0})
    b = RunResult("push", 1.0, 512, 8, 4, completed=3, failed=1, ttft_p50_ms=None, error="1 failed",
                  breakdown_ms={"write": 3.0, "ttft": 12.0})
    (merged,) = rounds.median_over_rounds([[a], [b]])
    assert merged.ttft_p50_ms == 10.0 and merged.rounds_ttft_p50_ms == [10.0, None]
    assert merged.breakdown_ms == {"write": 2.0, "ttft": 11.0}
    assert (merged.completed, merged.failed, merged.error) == (7, 1, "1 failed")


@pytest.mark.parametrize("argv", [["--rounds", "0"]])
def test_rounds_must_be_at_least_one(argv, capsys):
    from neuron_disagg.bench import cli

    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "--rounds" in capsys.readouterr().err
