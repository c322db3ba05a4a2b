"""The connector's scheduler side with small stand-ins for vLLM's requests and outputs: how one HTTP
request's several engine requests (prompt lists, n > 1) share transfers, and what it says it holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from neuron_disagg.vllm.scheduler import LegState, SchedulerSide, transfer_key  # noqa: E402
from neuron_disagg.kv_params import ParamsSigner  # noqa: E402
from neuron_disagg.protocol import TransferId  # noqa: E402

BLOCK = 16
TID = "req.1#0"
SIGNER = ParamsSigner(b"scheduler-side-tests-secret-0123456789")
PUSH_D = SIGNER.sign({"neuron_disagg": 1, "role": "decode", "mode": "push", "transfer_id": TID,
                      "p_side_channel": "127.0.0.1:1", "p_tp_size": 1})
PUSH_P = SIGNER.sign({"neuron_disagg": 1, "role": "prefill", "mode": "push", "transfer_id": TID})


def request(request_id, tokens, params, status="RUNNING"):
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(tokens), kv_transfer_params=params,
                           status=status)


def blocks(*ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def output(recving=(), sending=(), failed=()):
    return SimpleNamespace(finished_recving=set(recving), finished_sending=set(sending), failed_recving=set(failed),
                           invalid_block_ids=set())


A, B = range(1, 41), range(100, 130)


def held(side):
    """The held-blocks gauge the scheduler side reports now (None: unchanged since the last report)."""
    return (side.stats() or {}).get("held_blocks")


def test_each_prompt_of_a_request_is_its_own_transfer_named_alike_on_p_and_d():
    key_a, key_b = transfer_key(TransferId("req.1", 0), list(A)), transfer_key(TransferId("req.1", 0), list(B))
    assert key_a != key_b and key_a.request.startswith("req.1/") and key_a.attempt == 0
    d = SchedulerSide(BLOCK, SIGNER)
    for rid, tokens in (("0", A), ("1", B)):
        assert d.get_num_new_matched_tokens(request(rid, tokens, PUSH_D), 0) == (len(tokens), True)
    assert [e[0] for e in d.build_connector_meta(None).expect] == [key_a, key_b]


def test_samples_of_one_prompt_wait_for_the_first_then_compute_from_the_prefix_cache():
    d = SchedulerSide(BLOCK, SIGNER)
    first, second = request("0_r", A, PUSH_D), request("1_r", A, PUSH_D)
    assert d.get_num_new_matched_tokens(first, 0) == (40, True)
    assert d.get_num_new_matched_tokens(second, 0) == (None, False)  # ask again next step
    assert d.legs["1_r"].state is LegState.FOLLOWING
    d.update_state_after_alloc(first, blocks(5, 6, 7), 40)
    (registration,) = d.build_connector_meta(None).register
    assert registration.request_id == "0_r"  # one registration for the prompt
    assert d.get_num_new_matched_tokens(second, 0) == (None, False)  # still loading
    d.update_connector_output(output(recving={"0_r"}))
    assert d.get_num_new_matched_tokens(second, 32) == (0, False)  # loaded: vLLM's prefix cache has it
    assert "1_r" not in d.legs


def test_a_sibling_still_computes_when_the_first_fails_or_is_aborted():
    d = SchedulerSide(BLOCK, SIGNER)
    first, second = request("0_r", A, PUSH_D), request("1_r", A, PUSH_D)
    d.get_num_new_matched_tokens(first, 0)
    d.get_num_new_matched_tokens(second, 0)
    d.update_state_after_alloc(first, blocks(5, 6, 7), 40)
    d.update_connector_output(output(recving={"0_r"}, failed={"0_r"}))
    assert d.get_num_new_matched_tokens(second, 0) == (0, False)


def test_prefill_hands_one_siblings_blocks_over_and_frees_the_others():
    p = SchedulerSide(BLOCK, SIGNER)
    done = "FINISHED_LENGTH_CAPPED"
    first, second = request("0_r", A, PUSH_P, done), request("1_r", A, PUSH_P, done)
    for r in (first, second):
        p.get_num_new_matched_tokens(r, 0)
    assert p.request_finished(first, [3, 4, 5]) == (True, None)
    assert p.request_finished(second, [8, 9, 10]) == (False, None)  # freed at once
    (ready,) = p.build_connector_meta(None).kv_ready
    assert ready[1:] == ("0_r", (3, 4, 5))
    assert held(p) == 3
    p.update_connector_output(output(sending={"0_r"}))
    assert held(p) == 0 and not p.legs and not p.owner


def test_held_blocks_is_reported_when_it_changes():
    d = SchedulerSide(BLOCK, SIGNER)
    assert held(d) == 0
    assert held(d) is None  # unchanged: nothing to report
    r = request("0", A, PUSH_D)
    d.get_num_new_matched_tokens(r, 0)
    d.update_state_after_alloc(r, blocks(5, 6, 7), 40)
    assert held(d) == 3
    d.request_finished(r, [5, 6, 7])  # aborted while loading: held until the worker reports it
    assert d.legs["0"].state is LegState.ABORTING and held(d) is None
    d.update_connector_output(output(recving={"0"}))
    assert held(d) == 0


def test_a_pull_decode_takes_several_offers():
    d = SchedulerSide(BLOCK, SIGNER)
    params = SIGNER.sign({"neuron_disagg": 1, "role": "decode", "mode": "pull", "transfer_id": TID,
                          "offers": ["AAAA", "AQID"]})
    r = request("0", A, params)
    assert d.get_num_new_matched_tokens(r, 0) == (40, True)
    d.update_state_after_alloc(r, blocks(5, 6, 7), 40)
    (read,) = d.build_connector_meta(None).read
    assert read[1] == (b"\0\0\0", b"\1\2\3")


@pytest.mark.parametrize("failed", [False, True], ids=["loaded", "failed"])
def test_a_finished_load_stops_holding_while_its_request_decodes(failed):
    d = SchedulerSide(BLOCK, SIGNER)
    r = request("0", A, PUSH_D)
    d.get_num_new_matched_tokens(r, 0)
    d.update_state_after_alloc(r, blocks(5, 6, 7), 40)
    assert held(d) == 3
    d.update_connector_output(output(recving={"0"}, failed={"0"} if failed else ()))
    assert "0" in d.legs  # the request still runs: vLLM owns its blocks now, we hold none
    assert held(d) == 0
    d.request_finished(r, [5, 6, 7])
    assert held(d) is None and not d.legs


@pytest.mark.parametrize("forge", ["unsigned", "other secret", "altered side channel", "expired"])
def test_params_not_signed_by_this_deployment_run_as_plain_requests_and_are_counted(forge):
    """vLLM's HTTP port takes kv_transfer_params from anyone: only the router's signed ones are acted
    on. A forged set never reaches the worker (nothing to register, no side channel to contact)."""
    unsigned = {"neuron_disagg": 1, "role": "decode", "mode": "push", "transfer_id": TID,
                "p_side_channel": "10.9.9.9:5600", "p_tp_size": 1}
    params = {"unsigned": lambda: unsigned,
              "other secret": lambda: ParamsSigner(b"another-deployment-secret-0123456").sign(unsigned),
              "altered side channel": lambda: {**SIGNER.sign(unsigned), "p_side_channel": "10.6.6.6:5600"},
              "expired": lambda: SIGNER.sign(unsigned, now=0.0)}[forge]()
    d = SchedulerSide(BLOCK, SIGNER)
    r = request("0", A, params)
    assert d.get_num_new_matched_tokens(r, 0) == (0, False)  # computed here, like any request
    d.update_state_after_alloc(r, blocks(5, 6, 7), 0)
    step = d.build_connector_meta(None)
    assert not step.expect and not step.register and not d.legs
    assert d.stats()["counts"] == {"params_rejected": 1}
    assert "counts" not in (d.stats() or {})  # reported once
