"""The connector's scheduler side with small stand-ins for vLLM's requests and outputs: how one HTTP
request's several engine requests (prompt lists, n > 1) share transfers, and what it says it holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402

from neuron_disagg.vllm.decode import DECODE_TABLE, DecodeScheduler, DecodeState  # noqa: E402
from neuron_disagg.vllm.scheduler_side import END, LegEvent, transfer_key  # noqa: E402
from neuron_disagg.vllm.prefill import PREFILL_TABLE, PrefillScheduler, PrefillState  # noqa: E402
from neuron_disagg.kv_params import ParamsSigner  # noqa: E402
from neuron_disagg.protocol import TransferId  # noqa: E402

BLOCK = 16
TID = "req.1#0"
# Signed once, at collection: they must outlive a whole test run (the signer's TTL is checked).
SIGNER = ParamsSigner(b"scheduler-side-tests-secret-0123456789", ttl_s=7 * 86400)
# For a request of up to PROMPTS distinct prompts (the tests' prompt lists).
PROMPTS = 3
PUSH_D = SIGNER.sign({"neuron_disagg": 1, "role": "decode", "mode": "push", "transfer_id": TID,
                      "p_side_channel": "127.0.0.1:1", "p_tp_size": 1, "prompts": PROMPTS})
PUSH_P = SIGNER.sign({"neuron_disagg": 1, "role": "prefill", "mode": "push", "transfer_id": TID, "prompts": PROMPTS})


def request(request_id, tokens, params, status="RUNNING"):
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(tokens), kv_transfer_params=params,
                           status=status)


def blocks(*ids):
    """An allocation as vLLM hands it over: its own KVCacheBlocks of KVCacheBlock objects, in use."""
    return KVCacheBlocks(([KVCacheBlock(i, ref_cnt=1) for i in ids],))


def output(recving=(), sending=(), failed=(), failed_blocks=(5, 6, 7)):
    """A step's connector output; a failed load is said both ways: by request id (vLLM 0.32+) and by
    its blocks (older vLLM; the tests' failed loads had blocks 5, 6, 7)."""
    return SimpleNamespace(finished_recving=set(recving), finished_sending=set(sending), failed_recving=set(failed),
                           invalid_block_ids=set(failed_blocks) if failed else set())


A, B = range(1, 41), range(100, 130)


def one_token_request(request_id, status="FINISHED_LENGTH_CAPPED", tokens=A, params=PUSH_P, max_tokens=1):
    """A P request as the router sends it: one token to generate, so it ends with its prefill."""
    r = request(request_id, tokens, params, status)
    r.sampling_params = SimpleNamespace(max_tokens=max_tokens)
    return r


def step(new=None, cached=None, scheduled=None, preempted=(), resumed=()):
    """vLLM's SchedulerOutput as the connector reads it: ``new`` and ``cached`` map a request id to
    (tokens computed before the step, its new blocks or None); ``scheduled`` to its tokens this step."""
    new, cached = new or {}, cached or {}
    return SimpleNamespace(
        num_scheduled_tokens=dict(scheduled or {}), total_num_scheduled_tokens=sum((scheduled or {}).values()),
        preempted_req_ids=set(preempted),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(list(b),))
                            for r, (c, b) in new.items()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), resumed_req_ids=set(resumed),
            num_computed_tokens=[c for c, _ in cached.values()],
            new_block_ids=[None if b is None else (list(b),) for _, b in cached.values()]))


def held(side):
    """The held-blocks gauge the scheduler side reports now (None: unchanged since the last report)."""
    return (side.stats() or {}).get("held_blocks")


def test_each_prompt_of_a_request_is_its_own_transfer_named_alike_on_p_and_d():
    key_a, key_b = transfer_key(TransferId("req.1", 0), list(A)), transfer_key(TransferId("req.1", 0), list(B))
    assert key_a != key_b and key_a.request == "req.1" and key_a.prompt and key_a.attempt == 0
    assert key_a.router_attempt() == key_b.router_attempt() == TransferId("req.1", 0)
    d = DecodeScheduler(BLOCK, SIGNER)
    for rid, tokens in (("0", A), ("1", B)):
        assert d.get_num_new_matched_tokens(request(rid, tokens, PUSH_D), 0) == (len(tokens), True)
    assert [e.transfer_id for e in d.build_connector_meta(None).expect] == [key_a, key_b]


def test_samples_of_one_prompt_wait_for_the_first_then_compute_from_the_prefix_cache():
    d = DecodeScheduler(BLOCK, SIGNER)
    first, second = request("0_r", A, PUSH_D), request("1_r", A, PUSH_D)
    assert d.get_num_new_matched_tokens(first, 0) == (40, True)
    assert d.get_num_new_matched_tokens(second, 0) == (None, False)  # ask again next step
    assert d.legs["1_r"].state is DecodeState.FOLLOWING
    d.update_state_after_alloc(first, blocks(5, 6, 7), 40)
    (registration,) = d.build_connector_meta(None).register
    assert registration.request_id == "0_r"  # one registration for the prompt
    assert d.get_num_new_matched_tokens(second, 0) == (None, False)  # still loading
    d.update_connector_output(output(recving={"0_r"}))
    assert d.get_num_new_matched_tokens(second, 32) == (0, False)  # loaded: vLLM's prefix cache has it
    assert "1_r" not in d.legs


def test_a_sibling_still_computes_when_the_first_fails_or_is_aborted():
    d = DecodeScheduler(BLOCK, SIGNER)
    first, second = request("0_r", A, PUSH_D), request("1_r", A, PUSH_D)
    d.get_num_new_matched_tokens(first, 0)
    d.get_num_new_matched_tokens(second, 0)
    d.update_state_after_alloc(first, blocks(5, 6, 7), 40)
    d.update_connector_output(output(recving={"0_r"}, failed={"0_r"}))
    assert d.get_num_new_matched_tokens(second, 0) == (0, False)


def test_prefill_hands_one_siblings_blocks_over_and_frees_the_others():
    p = PrefillScheduler(BLOCK, SIGNER)
    done = "FINISHED_LENGTH_CAPPED"
    first, second = request("0_r", A, PUSH_P, done), request("1_r", A, PUSH_P, done)
    for r in (first, second):
        p.get_num_new_matched_tokens(r, 0)
    assert p.request_finished(first, [3, 4, 5]) == (True, None)
    assert p.request_finished(second, [8, 9, 10]) == (False, None)  # freed at once
    (ready,) = p.build_connector_meta(None).kv_ready
    assert (ready.request_id, ready.block_ids) == ("0_r", (3, 4, 5))
    assert held(p) == 3
    p.update_connector_output(output(sending={"0_r"}))
    assert held(p) == 0 and not p.legs and not p.owner


def test_held_blocks_is_reported_when_it_changes():
    d = DecodeScheduler(BLOCK, SIGNER)
    assert held(d) == 0
    assert held(d) is None  # unchanged: nothing to report
    r = request("0", A, PUSH_D)
    d.get_num_new_matched_tokens(r, 0)
    d.update_state_after_alloc(r, blocks(5, 6, 7), 40)
    assert held(d) == 3
    d.request_finished(r, [5, 6, 7])  # aborted while loading: held until the worker reports it
    assert d.legs["0"].state is DecodeState.ABORTING and held(d) is None
    d.update_connector_output(output(recving={"0"}))
    assert held(d) == 0


def test_a_pull_decode_takes_several_offers():
    d = DecodeScheduler(BLOCK, SIGNER)
    params = SIGNER.sign({"neuron_disagg": 1, "role": "decode", "mode": "pull", "transfer_id": TID,
                          "offers": ["AAAA", "AQID"]})
    r = request("0", A, params)
    assert d.get_num_new_matched_tokens(r, 0) == (40, True)
    d.update_state_after_alloc(r, blocks(5, 6, 7), 40)
    (read,) = d.build_connector_meta(None).read
    assert read.offers == (b"\0\0\0", b"\1\2\3")


@pytest.mark.parametrize("failed", [False, True], ids=["loaded", "failed"])
def test_a_finished_load_stops_holding_while_its_request_decodes(failed):
    d = DecodeScheduler(BLOCK, SIGNER)
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
    d = DecodeScheduler(BLOCK, SIGNER)
    r = request("0", A, params)
    assert d.get_num_new_matched_tokens(r, 0) == (0, False)  # computed here, like any request
    d.update_state_after_alloc(r, blocks(5, 6, 7), 0)
    step = d.build_connector_meta(None)
    assert not step.expect and not step.register and not d.legs
    assert d.stats()["counts"] == {"params_rejected": 1}
    assert "counts" not in (d.stats() or {})  # reported once


@pytest.mark.parametrize("side, params", [(DecodeScheduler, PUSH_P), (PrefillScheduler, PUSH_D)],
                         ids=["prefill leg to D", "decode leg to P"])
def test_a_leg_for_the_other_role_runs_as_a_plain_request_and_is_counted(side, params):
    """A router with P's and D's addresses swapped sends each instance the other role's signed legs:
    each is computed here as a plain request and counted; nothing reaches the worker."""
    instance = side(BLOCK, SIGNER)
    r = one_token_request("0", params=params)
    assert instance.get_num_new_matched_tokens(r, 0) == (0, False)
    instance.update_state_after_alloc(r, blocks(5, 6, 7), 0)
    assert instance.request_finished(r, [5, 6, 7]) == (False, None)
    assert not instance.build_connector_meta(step(new={"0": (0, [5, 6, 7])}, scheduled={"0": 40}))
    assert not instance.legs and not instance.unexpected
    assert instance.stats()["counts"] == {"params_for_other_role": 1}


@pytest.mark.parametrize("side", [DecodeScheduler, PrefillScheduler])
def test_params_are_good_for_one_requests_prompts_and_a_replay_runs_plainly(side):
    """A captured set sent again with another prompt (past the count the router signed), or with the
    same prompt later than a sibling would come, is computed here and counted: it moves no KV and
    makes P hold none. Siblings of the request itself (prompt lists, n > 1) keep working."""
    instance = side(BLOCK, SIGNER)
    params = PUSH_D if side is DecodeScheduler else PUSH_P
    t0 = 1000.0
    prompts = [range(1 + 50 * i, 41 + 50 * i) for i in range(PROMPTS + 1)]
    for i, tokens in enumerate(prompts[:PROMPTS]):  # the request's own prompt list
        r = one_token_request(f"{i}_r", tokens=tokens, params=params)
        r.arrival_time = t0
        instance.get_num_new_matched_tokens(r, 0)
        assert f"{i}_r" in instance.legs
    sample = one_token_request("0_s", tokens=prompts[0], params=params)  # n > 1: a sample of prompt 0
    sample.arrival_time = t0 + 0.01
    instance.get_num_new_matched_tokens(sample, 0)
    assert "0_s" in instance.legs
    another = one_token_request("x", tokens=prompts[PROMPTS], params=params)  # one prompt too many
    later = one_token_request("y", tokens=prompts[1], params=params)  # prompt 1 again, a minute on
    another.arrival_time, later.arrival_time = t0 + 5, t0 + 60
    for replay in (another, later):
        assert instance.get_num_new_matched_tokens(replay, 0) == (0, False)
        assert replay.request_id not in instance.legs
    assert instance.stats()["counts"] == {"params_replayed": 2}


def test_used_params_are_forgotten_once_they_expire_and_memory_is_bounded():
    from neuron_disagg import kv_params
    from neuron_disagg.vllm.scheduler_side import SingleUse

    uses = SingleUse(kept=2)
    first = kv_params.LegParams("decode", "push", TransferId("a"), signature="s1", expires_at=100.0)
    assert uses.admit(first, "p", arrived=0.0, now=0.0)
    assert not uses.admit(first, "q", arrived=1.0, now=1.0)
    assert uses.admit(first, "q", arrived=101.0, now=101.0)  # expired: would not verify anyway
    for n in range(2, 6):
        uses.admit(kv_params.LegParams("decode", "push", TransferId("a"), signature=f"s{n}", expires_at=1e12),
                   "p", arrived=102.0, now=102.0)
    assert len(uses._uses) == 2


# -- every row of both tables, reached through vLLM's calls only -------------------------------------
def _d_at(state):
    """A D scheduler side with request "0" (and "1", a sample of the same prompt) in ``state``."""
    d = DecodeScheduler(BLOCK, SIGNER)
    first, second = request("0", A, PUSH_D), request("1", A, PUSH_D)
    d.get_num_new_matched_tokens(first, 0)
    if state is DecodeState.FOLLOWING:
        d.get_num_new_matched_tokens(second, 0)
        return d, second
    if state is not DecodeState.WAITING_FOR_BLOCKS:
        d.update_state_after_alloc(first, blocks(5, 6, 7), 40)
    if state is DecodeState.ABORTING:
        d.request_finished(first, [5, 6, 7])
    if state in (DecodeState.LOADED, DecodeState.FAILED):
        d.update_connector_output(output(recving={"0"}, failed={"0"} if state is DecodeState.FAILED else ()))
    assert d.legs["0"].state is state
    return d, first


def _p_at(state):
    p = PrefillScheduler(BLOCK, SIGNER)
    r = request("0", A, PUSH_P, "FINISHED_LENGTH_CAPPED")
    p.get_num_new_matched_tokens(r, 0)
    if state is PrefillState.HANDED_OFF:
        p.request_finished(r, [3, 4, 5])
    assert p.legs["0"].state is state
    return p, r


def _p_last_chunk(sibling=False):
    """An async-scheduling P whose request "0" had its prompt's last tokens scheduled (and a sibling
    "1" of the same prompt, handed off already, when ``sibling``). That step's metadata names the
    prompt's blocks, for the writer to plan during the forward, unless a sibling's KV went instead."""
    p = PrefillScheduler(BLOCK, SIGNER, async_scheduling=True)
    if sibling:
        p.get_num_new_matched_tokens(one_token_request("1"), 0)
        p.build_connector_meta(step(new={"1": (0, [8, 9, 10])}, scheduled={"1": 40}))
        p.build_connector_meta(step())
    r = one_token_request("0")
    p.get_num_new_matched_tokens(r, 0)
    meta = p.build_connector_meta(step(new={"0": (0, [3, 4, 5, 6])}, scheduled={"0": 40}))
    assert p.legs["0"].state is PrefillState.LAST_CHUNK
    assert [(k.request_id, k.block_ids) for k in meta.kv_coming] == ([] if sibling else [("0", (3, 4, 5))])
    return p, r


def _p_handed_off_early():
    p = PrefillScheduler(BLOCK, SIGNER)
    r = one_token_request("0")
    p.get_num_new_matched_tokens(r, 0)
    p.build_connector_meta(step(new={"0": (0, [3, 4, 5])}, scheduled={"0": 40}))
    return p, r


def _sibling_done(d, r):
    d.update_state_after_alloc(request("0", A, PUSH_D), blocks(5, 6, 7), 40)
    d.update_connector_output(output(recving={"0"}))  # the first one loaded
    return d.get_num_new_matched_tokens(r, 32)


ROWS = {
    (DecodeState.NEW, LegEvent.ASKED): (lambda: _d_at(DecodeState.WAITING_FOR_BLOCKS), None, DecodeState.WAITING_FOR_BLOCKS),
    (DecodeState.WAITING_FOR_BLOCKS, LegEvent.ALLOCATED): (lambda: _d_at(DecodeState.LOADING), None, DecodeState.LOADING),
    (DecodeState.WAITING_FOR_BLOCKS, LegEvent.ENDED): (
        lambda: _d_at(DecodeState.WAITING_FOR_BLOCKS), lambda d, r: d.request_finished(r, []), END),
    (DecodeState.FOLLOWING, LegEvent.OWNER_DONE): (lambda: _d_at(DecodeState.FOLLOWING), _sibling_done, END),
    (DecodeState.FOLLOWING, LegEvent.ENDED): (lambda: _d_at(DecodeState.FOLLOWING), lambda d, r: d.request_finished(r, []), END),
    (DecodeState.LOADING, LegEvent.LOADED): (lambda: _d_at(DecodeState.LOADED), None, DecodeState.LOADED),
    (DecodeState.LOADING, LegEvent.LOAD_FAILED): (lambda: _d_at(DecodeState.FAILED), None, DecodeState.FAILED),
    (DecodeState.LOADING, LegEvent.ENDED): (lambda: _d_at(DecodeState.ABORTING), None, DecodeState.ABORTING),
    (DecodeState.ABORTING, LegEvent.LOADED): (
        lambda: _d_at(DecodeState.ABORTING), lambda d, r: d.update_connector_output(output(recving={"0"})), END),
    (DecodeState.ABORTING, LegEvent.LOAD_FAILED): (
        lambda: _d_at(DecodeState.ABORTING), lambda d, r: d.update_connector_output(output(recving={"0"}, failed={"0"})), END),
    (DecodeState.LOADED, LegEvent.ENDED): (lambda: _d_at(DecodeState.LOADED), lambda d, r: d.request_finished(r, [5, 6, 7]), END),
    (DecodeState.FAILED, LegEvent.ENDED): (lambda: _d_at(DecodeState.FAILED), lambda d, r: d.request_finished(r, [5, 6, 7]), END),
    (PrefillState.PREFILLING, LegEvent.HANDED_OFF): (lambda: _p_at(PrefillState.HANDED_OFF), None, PrefillState.HANDED_OFF),
    (PrefillState.PREFILLING, LegEvent.SIBLING_HANDED_OFF): (
        lambda: _p_at(PrefillState.HANDED_OFF),
        lambda p, r: p.request_finished(request("1", A, PUSH_P, "FINISHED_LENGTH_CAPPED"), [8, 9, 10]), "1 forgotten"),
    (PrefillState.PREFILLING, LegEvent.ENDED): (
        lambda: _p_at(PrefillState.PREFILLING),
        lambda p, r: p.request_finished(request("0", A, PUSH_P, "FINISHED_ABORTED"), [3, 4, 5]), END),
    (PrefillState.HANDED_OFF, LegEvent.SENT): (
        lambda: _p_at(PrefillState.HANDED_OFF), lambda p, r: p.update_connector_output(output(sending={"0"})), END),
    (PrefillState.PREFILLING, LegEvent.LAST_CHUNK): (_p_last_chunk, None, PrefillState.LAST_CHUNK),
    (PrefillState.LAST_CHUNK, LegEvent.HANDED_OFF): (
        _p_last_chunk, lambda p, r: p.build_connector_meta(step()), PrefillState.HANDED_OFF),
    (PrefillState.LAST_CHUNK, LegEvent.PREEMPTED): (
        _p_last_chunk, lambda p, r: p.build_connector_meta(step(preempted={"0"})), PrefillState.PREFILLING),
    (PrefillState.LAST_CHUNK, LegEvent.SIBLING_HANDED_OFF): (
        lambda: _p_last_chunk(sibling=True), lambda p, r: p.request_finished(r, [3, 4, 5]), END),
    (PrefillState.LAST_CHUNK, LegEvent.ENDED): (
        _p_last_chunk, lambda p, r: p.request_finished(one_token_request("0", "FINISHED_ABORTED"), []), END),
    (PrefillState.HANDED_OFF, LegEvent.ENDED): (
        _p_handed_off_early, lambda p, r: p.request_finished(r, [3, 4, 5]), PrefillState.HANDED_OFF),
}


def test_the_rows_below_are_every_row_of_both_tables():
    assert set(ROWS) == set(DECODE_TABLE) | set(PREFILL_TABLE)


@pytest.mark.parametrize("row", list(ROWS), ids=lambda row: f"{row[0].value}-{row[1].value}")
def test_each_row_moves_the_leg_as_its_table_says(row):
    start, act, expected = ROWS[row]
    side, r = start()
    if act is not None:
        if row[1] is LegEvent.SIBLING_HANDED_OFF:
            side.get_num_new_matched_tokens(request("1", A, PUSH_P), 0)  # the sibling, still prefilling
        act(side, r)
    if expected == "1 forgotten":
        assert "1" not in side.legs and side.legs["0"].state is PrefillState.HANDED_OFF
    elif expected is END:
        assert r.request_id not in side.legs
    else:
        assert side.legs[r.request_id].state is expected
        table = PREFILL_TABLE if isinstance(expected, PrefillState) else DECODE_TABLE
        assert table[row] is expected
    assert not side.unexpected


def test_a_transition_no_table_has_is_counted_and_changes_nothing():
    d, r = _d_at(DecodeState.LOADED)
    d.update_connector_output(output(recving={"0"}))  # a second report of the same load
    assert d.legs["0"].state is DecodeState.LOADED
    assert d.unexpected == {"loaded:loaded": 1}


def test_a_preempted_request_whose_kv_arrived_recomputes_from_its_own_cache_and_asks_nothing_of_p():
    """vLLM preempts a running request by freeing its blocks and asks the connector again when it
    reschedules it: the KV that arrived is gone or in the prefix cache, so it computes locally."""
    d, r = _d_at(DecodeState.LOADED)
    d.build_connector_meta(None)
    assert d.get_num_new_matched_tokens(r, 16) == (0, False)
    assert d.legs["0"].state is DecodeState.LOADED and not d.build_connector_meta(None)
    assert held(d) in (None, 0)


# -- P hands a finished prefill over when its forward ends, not at the request's end ----------------
def test_a_prefill_goes_to_the_writer_after_the_forward_that_ends_it():
    p = PrefillScheduler(BLOCK, SIGNER)
    r = one_token_request("0")
    p.get_num_new_matched_tokens(r, 0)
    meta = p.build_connector_meta(step(new={"0": (0, [3, 4, 5, 6])}, scheduled={"0": 40}))
    (ready,) = meta.kv_ready_after_forward  # the worker hands it over in wait_for_save
    assert (ready.request_id, ready.block_ids) == ("0", (3, 4, 5)) and not meta.kv_ready
    assert p.request_finished(r, [3, 4, 5, 6]) == (True, None)  # held until the writer is done
    assert not p.build_connector_meta(step()) and not p.unexpected
    p.update_connector_output(output(sending={"0"}))
    assert not p.legs and not p.owner


def test_a_chunked_prefill_is_handed_over_with_every_chunks_blocks():
    p = PrefillScheduler(BLOCK, SIGNER, stream=False)
    r = one_token_request("0")
    p.get_num_new_matched_tokens(r, 0)
    assert not p.build_connector_meta(step(new={"0": (0, [3])}, scheduled={"0": 16}))
    assert not p.build_connector_meta(step(cached={"0": (16, [4])}, scheduled={"0": 16}))
    assert not p.build_connector_meta(step(cached={"1": (0, [9])}, scheduled={"1": 16}))  # others' steps
    (ready,) = p.build_connector_meta(step(cached={"0": (32, [5])}, scheduled={"0": 8})).kv_ready_after_forward
    assert ready.block_ids == (3, 4, 5)
    assert p.request_finished(r, [3, 4, 5]) == (True, None) and not p.unexpected


def test_a_streamed_prefill_sends_each_steps_finished_blocks_after_its_forward_and_the_rest_at_the_end():
    p = PrefillScheduler(BLOCK, SIGNER)
    r = one_token_request("0")
    p.get_num_new_matched_tokens(r, 0)
    (chunk,) = p.build_connector_meta(step(new={"0": (0, [3])}, scheduled={"0": 16})).chunks_after_forward
    assert chunk.block_ids == (3,)
    half = p.build_connector_meta(step(cached={"0": (16, [4])}, scheduled={"0": 8}))  # fills no block
    assert not half
    (chunk,) = p.build_connector_meta(step(cached={"0": (24, None)}, scheduled={"0": 8})).chunks_after_forward
    assert chunk.block_ids == (3, 4)  # every finished block so far, in the prompt's order
    out = p.build_connector_meta(step(cached={"0": (32, [5])}, scheduled={"0": 8}))
    assert not out.chunks_after_forward and out.kv_ready_after_forward[0].block_ids == (3, 4, 5)
    assert p.counts["chunks_streamed"] == 2


def test_of_siblings_sharing_a_transfer_only_the_first_streams_it():
    p = PrefillScheduler(BLOCK, SIGNER)
    first, second = one_token_request("0_r"), one_token_request("1_r")  # one prompt, twice (n > 1)
    for r in (first, second):
        p.get_num_new_matched_tokens(r, 0)
    out = p.build_connector_meta(step(new={"0_r": (0, [3]), "1_r": (0, [8])}, scheduled={"0_r": 16, "1_r": 16}))
    assert [(c.request_id, c.block_ids) for c in out.chunks_after_forward] == [("0_r", (3,))]
    p.request_finished(one_token_request("0_r", "FINISHED_ABORTED"), [3])  # the streamer leaves
    out = p.build_connector_meta(step(cached={"1_r": (16, [9])}, scheduled={"1_r": 16}))
    assert [(c.request_id, c.block_ids) for c in out.chunks_after_forward] == [("1_r", (8, 9))]


def test_a_streamed_prefill_that_vllm_preempts_is_reported_so_its_stream_is_written_again():
    p = PrefillScheduler(BLOCK, SIGNER)
    r = one_token_request("0")
    p.get_num_new_matched_tokens(r, 0)
    p.build_connector_meta(step(new={"0": (0, [3])}, scheduled={"0": 16}))
    out = p.build_connector_meta(step(preempted={"0"}))
    assert out.preempted == [p.legs["0"].key]
    assert not p.build_connector_meta(step(new={"0": (0, [7, 8, 9])}, scheduled={"0": 40}))  # not followed now
    assert p.request_finished(r, [7, 8, 9]) == (True, None)  # sent whole at its end
    assert p.build_connector_meta(step()).kv_ready[0].block_ids == (7, 8, 9)


def test_async_scheduling_hands_over_a_step_later_unless_that_step_preempted_it():
    p, r = _p_last_chunk()
    (ready,) = p.build_connector_meta(step()).kv_ready  # at the next step's start
    assert ready.block_ids == (3, 4, 5)
    assert not _p_last_chunk(sibling=True)[0].build_connector_meta(step()).kv_ready  # a sibling's was sent
    p, r = _p_last_chunk()
    # Its blocks were freed: nothing handed over, but the writer hears it, since that forward may
    # have streamed the prompt by layers from blocks vLLM may reuse now.
    freed = p.build_connector_meta(step(preempted={"0"}))
    assert not freed.kv_ready and freed.preempted == [p.legs["0"].key]
    assert not p.build_connector_meta(step(new={"0": (0, [7, 8, 9])}, scheduled={"0": 40}))
    assert p.request_finished(r, [7, 8, 9]) == (True, None)  # computed again: sent at its end
    assert p.build_connector_meta(step()).kv_ready[0].block_ids == (7, 8, 9)
    p, r = _p_last_chunk()
    assert p.request_finished(r, [3, 4, 5]) == (True, None)  # its output came in before the next step
    assert p.build_connector_meta(step()).kv_ready[0].block_ids == (3, 4, 5)
    assert not p.build_connector_meta(step()) and not any(leg.early for leg in p.legs.values())


def test_a_request_ended_after_an_early_hand_off_stops_its_write_and_keeps_its_blocks_until_then():
    p, r = _p_handed_off_early()
    assert p.request_finished(one_token_request("0", "FINISHED_ABORTED"), [3, 4, 5]) == (True, None)
    (abort,) = p.build_connector_meta(step()).abort
    assert abort.reason.startswith("prefill request ended") and held(p) == 3
    p.update_connector_output(output(sending={"0"}))
    assert not p.legs and held(p) == 0


def test_only_a_one_token_push_prefill_is_handed_over_early():
    for r in (one_token_request("0", max_tokens=2), request("0", A, PUSH_P, "FINISHED_LENGTH_CAPPED")):
        p = PrefillScheduler(BLOCK, SIGNER)
        p.get_num_new_matched_tokens(r, 0)
        assert not p.build_connector_meta(step(new={"0": (0, [3, 4, 5])}, scheduled={"0": 40}))
        assert p.request_finished(r, [3, 4, 5]) == (True, None)
        assert p.build_connector_meta(step()).kv_ready[0].block_ids == (3, 4, 5)


def test_blocks_that_differ_from_what_vllm_ends_the_request_with_are_a_counted_bug():
    p, r = _p_handed_off_early()
    assert p.request_finished(r, [3, 4, 7]) == (True, None)
    assert p.unexpected == {"early_blocks_differ": 1}


def test_a_sibling_that_finishes_its_prefill_later_is_freed_at_its_end():
    p = PrefillScheduler(BLOCK, SIGNER)
    first, second = one_token_request("0"), one_token_request("1")
    for r in (first, second):
        p.get_num_new_matched_tokens(r, 0)
    meta = p.build_connector_meta(step(new={"0": (0, [3, 4, 5]), "1": (0, [8, 9, 10])},
                                       scheduled={"0": 40, "1": 40}))
    assert [k.request_id for k in meta.kv_ready_after_forward] == ["0"]
    assert p.request_finished(second, [8, 9, 10]) == (False, None)
    assert p.request_finished(first, [3, 4, 5]) == (True, None) and not p.unexpected


def test_a_sample_that_arrives_after_its_sibling_ended_computes_from_the_prefix_cache_at_once():
    """vLLM adds each sample (n > 1) and each prompt of a list as its own engine request: on a busy
    host one can reach the scheduler after its sibling loaded, decoded and ended. Asking for the
    transfer again would wait for a KV that P already sent (in CI, for ever, its blocks held)."""
    d = DecodeScheduler(BLOCK, SIGNER)
    first = request("0_r", A, PUSH_D)
    assert d.get_num_new_matched_tokens(first, 0) == (40, True)
    d.update_state_after_alloc(first, blocks(5, 6, 7), 40)
    d.update_connector_output(output(recving={"0_r"}))
    assert d.request_finished(first, [5, 6, 7]) == (False, None) and not d.legs
    d.build_connector_meta(None)
    late = request("1_r", A, PUSH_D)
    assert d.get_num_new_matched_tokens(late, 32) == (0, False)
    meta = d.build_connector_meta(None)
    assert not meta.expect and not meta.register and not d.legs and not d.unexpected
    other = request("0_s", B, PUSH_D)  # another prompt of the request still loads
    assert d.get_num_new_matched_tokens(other, 0) == (30, True)


def test_a_prefill_sibling_that_arrives_after_the_kv_was_sent_is_freed_at_once(monkeypatch):
    p = PrefillScheduler(BLOCK, SIGNER)
    first = one_token_request("0")
    p.get_num_new_matched_tokens(first, 0)
    p.build_connector_meta(step(new={"0": (0, [3, 4, 5])}, scheduled={"0": 40}))  # handed over early
    assert p.request_finished(first, [3, 4, 5]) == (True, None)
    p.update_connector_output(output(sending={"0"}))
    assert not p.legs
    late = one_token_request("1")
    p.get_num_new_matched_tokens(late, 0)
    meta = p.build_connector_meta(step(new={"1": (0, [8, 9, 10])}, scheduled={"1": 40}))
    assert not meta.kv_ready_after_forward and not meta.kv_ready
    assert p.request_finished(late, [8, 9, 10]) == (False, None)  # vLLM frees its blocks now
    assert not p.build_connector_meta(None).kv_ready and not p.legs and not p.unexpected


def test_ended_transfers_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr("neuron_disagg.vllm.scheduler_side.ENDED_KEPT", 2)
    d = DecodeScheduler(BLOCK, SIGNER)
    for i, tokens in enumerate((A, B, range(200, 220))):
        r = request(f"{i}_r", tokens, PUSH_D)
        d.get_num_new_matched_tokens(r, 0)
        d.request_finished(r, [])
    assert list(d.ended) == [transfer_key(TransferId("req.1", 0), list(t)) for t in (B, range(200, 220))]


def test_each_step_tells_the_workers_whether_it_runs_a_forward():
    d = DecodeScheduler(BLOCK, SIGNER)
    assert d.build_connector_meta(step()).no_forward
    assert not d.build_connector_meta(step(scheduled={"r": 1})).no_forward
    assert not d.build_connector_meta(None).no_forward


@pytest.mark.parametrize("ends_first", [False, True], ids=["scheduled", "aborted-before"])
def test_the_timeline_marks_a_loaded_requests_first_step_once(tmp_path, ends_first):
    """``d_scheduled``: from ``d_loaded`` to it is vLLM's own loop, which the bench shows apart."""
    import json

    from neuron_disagg.timeline import Timeline

    d = DecodeScheduler(BLOCK, SIGNER, timeline=Timeline(tmp_path, "decode-scheduler"))
    loaded, waiting = request("0", A, PUSH_D), request("1", B, PUSH_D)
    for r, ids in ((loaded, (5, 6, 7)), (waiting, (8, 9))):
        d.get_num_new_matched_tokens(r, 0)
        d.update_state_after_alloc(r, blocks(*ids), len(r.prompt_token_ids))
    d.build_connector_meta(step(scheduled={"1": 1}))  # a request not loaded: not marked
    d.update_connector_output(output(recving={"0"}))
    d.build_connector_meta(step())  # scheduled nothing: vLLM's loop has not taken it yet
    if ends_first:
        d.request_finished(loaded, [5, 6, 7])
    d.build_connector_meta(step(scheduled={"0": 1}))
    d.build_connector_meta(step(scheduled={"0": 1}))  # its second step is not its first
    d.timeline.close()
    (written,) = tmp_path.iterdir()
    marks = [json.loads(line) for line in written.read_text().splitlines()]
    key = "req.1#0"  # filed under the router's transfer id
    assert [k for k, event, _ in marks if event == "d_loaded"] == [key]
    assert [k for k, event, _ in marks if event == "d_scheduled"] == ([] if ends_first else [key])
    assert not any(leg.awaiting_first_step for leg in d.legs.values())  # nothing kept for one that ended
