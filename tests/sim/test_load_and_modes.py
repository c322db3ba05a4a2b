"""Direction checks: TTFT rises with load; push never has a later first token than pull when
posting descriptors costs something; the TPOT gap comes from posting on D's loop and vanishes
without it; a fixed seed gives the same run."""

from __future__ import annotations

import pytest

from neuron_disagg.sim import Scenario, simulate, summarize

RATES = [0.5, 1.0, 2.0, 4.0, 7.0]


@pytest.mark.parametrize("mode", ["push", "pull", "none"])
def test_ttft_rises_with_load(p5en, mode):
    # Same seed: arrival times at rate 2r are those at rate r, halved; only the load changes.
    means = [summarize(simulate(p5en, Scenario(mode, r, 16384, output_len=32, requests=150, seed=5))).ttft_mean_ms
             for r in RATES]
    assert all(a < b for a, b in zip(means, means[1:])), means


@pytest.mark.parametrize("rate,input_len", [(1.0, 1024), (4.0, 4096), (8.0, 8192), (8.0, 16384)])
def test_push_first_token_no_later_than_pull(p5en, rate, input_len):
    assert p5en.v("post_s_per_desc") > 0
    push, pull = (summarize(simulate(p5en, Scenario(m, rate, input_len, output_len=64, requests=150, seed=2)))
                  for m in ("push", "pull"))
    assert push.ttft_mean_ms <= pull.ttft_mean_ms
    assert push.ttft_p50_ms <= pull.ttft_p50_ms


def test_pull_tpot_gap_comes_from_posting_on_the_decode_loop(p5en):
    def tpot_gap(profile):
        push, pull = (summarize(simulate(profile, Scenario(m, 8.0, 16384, output_len=64, requests=150, seed=4)))
                      for m in ("push", "pull"))
        return pull.tpot_mean_ms / push.tpot_mean_ms, pull

    with_cost, pull = tpot_gap(p5en)
    free, _ = tpot_gap(p5en.replace(post_s_per_desc=0.0, pull_prep_s_per_desc=0.0, d_admit_s=0.0))
    assert with_cost > 1.2 and pull.d_loop_busy_fraction > 0.1
    assert free == pytest.approx(1.0, abs=0.03)


def test_same_seed_same_run_other_seed_other_run(p5en):
    def stamps(seed):
        run = simulate(p5en, Scenario("pull", 4.0, 4096, output_len=32, requests=80, seed=seed))
        return [(r.spec.arrival_s, r.prefill_end_s, r.kv_loaded_s, r.first_token_s, r.done_s) for r in run.records]

    assert stamps(11) == stamps(11)
    assert stamps(11) != stamps(12)


def test_shipped_p5en_profile_has_pull_slower_at_8qps_16k(p5en):
    """The published direction (pull slower than push in TTFT and TPOT); not the magnitudes."""
    push, pull = (summarize(simulate(p5en, Scenario(m, 8.0, 16384, requests=300, seed=0))) for m in ("push", "pull"))
    assert pull.ttft_p50_ms > push.ttft_p50_ms
    assert pull.tpot_p50_ms > push.tpot_p50_ms
