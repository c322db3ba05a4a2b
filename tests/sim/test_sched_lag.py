"""Mechanics of the scheduler lag (``sched_lag_steps``): an engine learns that a transfer finished
from the output of the step in flight, and under async scheduling one schedule later still. D: an
idle loop sees a completion at once, a busy one one decode step later. P: a lease noticed during a
step is freed at that step's end, one step later with the lag."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from neuron_disagg.sim import Scenario, simulate, summarize
from neuron_disagg.sim.prefill import PrefillInstance
from neuron_disagg.sim.records import Record
from neuron_disagg.sim.steptime import prefill_chunk_s
from neuron_disagg.sim.workload import RequestSpec


def lagged(profile, steps: int):
    return profile.replace(sched_lag_steps=float(steps))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_idle_decode_sees_a_completion_at_once(p5en, mode):
    # 5 s between arrivals, 4 output tokens: D has finished everything before the next KV arrives.
    sc = Scenario(mode, 0.2, 1024, output_len=4, requests=20, seed=1)
    ttft = [[r.ttft_s for r in simulate(lagged(p5en, k), sc).records] for k in (0, 1)]
    assert ttft[0] == pytest.approx(ttft[1], abs=1e-12)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_busy_decode_sees_a_completion_one_step_later(p5en, mode):
    sc = Scenario(mode, 4.0, 4096, output_len=128, requests=200, seed=3)
    runs = [simulate(lagged(p5en, k), sc) for k in (0, 1)]
    join = [np.mean([r.first_token_s - r.kv_loaded_s for r in run.records]) for run in runs]
    step = summarize(runs[0]).tpot_p50_ms / 1e3  # one decode step at this load
    # D is stepping nearly always at this load: the lag adds about one step to every join.
    assert 0.6 * step < join[1] - join[0] < 1.4 * step, (join, step)


def _prefill_with_a_lease_noticed_mid_step(profile, lag: int):
    """P holds room for a 4k and an 8k prompt; 1k chunks, two per step. The 4k prompt finishes
    first; its read-done notice arrives 1 ms into the next step, while the 8k prompt still runs. A
    third (4k) prompt needs the 4k prompt's blocks. Returns (notice time, free blocks just after
    the notice, blocks held then, third prompt's start)."""
    g = profile.geometry
    profile = lagged(profile.replace(p_blocks=float(g.blocks(4096) + g.blocks(8192))), lag)
    env = simpy.Environment()
    seen = {}

    def kv_ready(record):
        if record.spec.rid == 0:
            def notice():
                yield env.timeout(1e-3)
                seen["notice_s"] = env.now
                p.release(record)
                seen["free_after_notice"] = p.free_blocks
            env.process(notice())

    p = PrefillInstance(env, 0, profile, on_kv_ready=kv_ready, chunk_tokens=1024, max_batch_tokens=2048)
    records = [Record(RequestSpec(rid, 0.0, n, 1)) for rid, n in enumerate((4096, 8192, 4096))]
    for r in records:
        p.submit(r)
    env.run(until=5.0)
    return seen["notice_s"], seen["free_after_notice"], g.blocks(4096), records[2].prefill_start_s


def test_prefill_frees_a_noticed_lease_only_at_a_step_end(p5en):
    notice, free_then, held, start = _prefill_with_a_lease_noticed_mid_step(p5en, 0)
    assert free_then == 0  # still held: P frees from its own loop, not when the notice lands
    assert start > notice  # freed at the end of the step in flight, the next step takes the prompt
    _, free_then_lagged, _, start_lagged = _prefill_with_a_lease_noticed_mid_step(p5en, 1)
    assert free_then_lagged == 0
    # one more P step with the scheduler lag: at most one step of the 8k prompt's last chunks
    longest_step = p5en.v("prefill_step_base_s") + prefill_chunk_s(p5en, 8192 - 1024, 1024)
    assert 0 < start_lagged - start <= longest_step + 1e-9
