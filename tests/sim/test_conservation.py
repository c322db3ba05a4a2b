"""Every arrival finishes exactly once, with its full output, in every mode and topology, and every
KV pool is back to full when the run ends (the simulator's version of invariants I3 and I4)."""

from __future__ import annotations

import pytest

from neuron_disagg.sim import Scenario, simulate

CASES = [
    dict(mode="push"), dict(mode="pull"), dict(mode="none"),
    dict(mode="push", num_p=2, num_d=3), dict(mode="pull", num_p=3, num_d=2),
    dict(mode="push", chunk_tokens=1024, max_batch_tokens=2048),
    dict(mode="pull", burstiness=0.25),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_every_request_finishes_exactly_once(p5en, case):
    # Pools for ~3 prompts force requests to wait for blocks: leases must hand them back.
    profile = p5en.replace(p_blocks=3 * 512, d_blocks=3 * 520)
    sc = Scenario(rate=6.0, input_len=8192, output_len=16, requests=60, seed=3, **case)
    run = simulate(profile, sc)
    assert sorted(r.spec.rid for r in run.records) == list(range(sc.requests))
    for r in run.records:
        assert r.finished_count == 1, r.spec.rid
        assert r.first_token_s is not None and r.done_s is not None and r.first_token_s <= r.done_s
        assert r.spec.arrival_s <= r.prefill_start_s <= r.prefill_end_s <= r.first_token_s
        if sc.mode != "none":
            assert r.tokens_out == sc.output_len
            assert r.prefill_end_s <= r.transfer_start_s <= r.kv_loaded_s < r.first_token_s
    assert run.leaks == []


def test_a_prompt_larger_than_the_pool_is_refused_with_a_fix(p5en):
    from neuron_disagg.sim import CapacityError

    with pytest.raises(CapacityError, match="p_blocks"):
        simulate(p5en.replace(p_blocks=100), Scenario("push", 1.0, 8192, requests=2))
