"""Our connector's scheduler side driven by vLLM's own scheduler and KV cache manager (tests/vllm/
engine.py): push and pull legs on P and D through allocation and registration, load, finish, abort
while loading, siblings of one request, a failed load that is recomputed, preemption — the blocks
vLLM holds checked at every turn. Runs in every vLLM environment set-up builds, including 0.33 and
0.34, which no CPU build serves (tests/test_vllm_versions.py)."""

from __future__ import annotations

import base64

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
# vLLM inspects the model's class in a child process the first time (it caches the answer after).
pytestmark = pytest.mark.integration

from neuron_disagg import kv_params  # noqa: E402
from neuron_disagg.config import Config  # noqa: E402
from neuron_disagg.protocol import RankRegions  # noqa: E402
from neuron_disagg.vllm import compat  # noqa: E402
from neuron_disagg.vllm.metadata import RankHandshake  # noqa: E402

from .engine import BLOCK, Engine  # noqa: E402

SECRET = "engine-scheduler-tests-secret-0123456789"
PROMPT = list(range(100, 140))  # 40 tokens: two full blocks and a part
OTHER = list(range(300, 348))


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", SECRET)


def signer():
    return Config().params_signer()


def push_d(tid: str, prompts: int = 1) -> dict:
    return kv_params.push_decode(signer(), tid, "127.0.0.1:1", 1, prompts)


def prefill(tid: str, mode: str = "push", prompts: int = 1) -> dict:
    return kv_params.prefill(signer(), mode, tid, prompts)


def test_the_connector_passes_this_vllms_api_check_and_answers_its_hooks():
    version = compat.check_runtime()
    assert compat.parse(version) >= compat.OLDEST
    d = Engine("decode")
    assert type(d.connector).__name__ == "NeuronDisaggConnector" and type(d.side).__name__ == "DecodeScheduler"
    assert d.connector.has_pending_push_work() is False


def test_a_push_decode_leg_registers_its_fresh_blocks_loads_and_decodes():
    d = Engine("decode")
    free = d.free_blocks
    r = d.add(PROMPT, push_d("push-d#0"), max_tokens=3)
    step = d.step()
    (expected,), (registered,) = step.metadata.expect, step.metadata.register
    assert expected.p_side_channel == "127.0.0.1:1" and registered.request_id == r.request_id
    assert list(registered.block_ids) == d.blocks_of(r.request_id)[:3] and r.status.name == "WAITING_FOR_REMOTE_KVS"
    assert not step.sampled and d.free_blocks == free - 3
    d.step(loaded={r.request_id})
    for _ in range(6):
        d.step()
    assert r.status.name == "FINISHED_LENGTH_CAPPED" and r.num_output_tokens == 3
    assert d.free_blocks == free and not d.side.legs


def test_a_decode_leg_aborted_while_loading_keeps_its_blocks_until_the_worker_reports_them():
    d = Engine("decode")
    free = d.free_blocks
    r = d.add(PROMPT, push_d("abort-d#0"))
    d.step()
    d.abort(r)
    step = d.step()
    (abort,) = step.metadata.abort
    assert abort.transfer_id.request == "abort-d" and d.free_blocks == free - 3  # P may still be writing (I2)
    d.step(loaded={r.request_id})  # the fence passed: the worker reports the blocks
    d.step()
    assert d.free_blocks == free and not d.side.legs


def test_samples_of_one_prompt_load_once_and_the_others_compute_from_the_prefix_cache():
    d = Engine("decode")
    free = d.free_blocks
    params = push_d("siblings#0")
    first, second = d.add(PROMPT, params, max_tokens=2), d.add(PROMPT, params, max_tokens=2)
    step = d.step()
    assert [a.request_id for a in step.metadata.register] == [first.request_id]  # one registration
    computed = d.step(loaded={first.request_id}).output.num_scheduled_tokens.get(second.request_id, 0)
    for _ in range(6):
        step = d.step()
        assert not step.metadata.register
        computed += step.output.num_scheduled_tokens.get(second.request_id, 0)
    assert first.status.name == second.status.name == "FINISHED_LENGTH_CAPPED"
    assert 0 < computed <= len(PROMPT) - 2 * BLOCK + 1  # its full blocks read from what the load filled
    assert d.free_blocks == free and not d.side.legs


def test_a_failed_load_is_recomputed_by_decode_and_registers_nothing_again():
    d = Engine("decode", recompute=True)
    free = d.free_blocks
    r = d.add(PROMPT, push_d("failed-d#0"), max_tokens=2)
    d.step()
    d.step(failed={r.request_id})
    computed = 0
    for _ in range(6):
        step = d.step()
        assert not step.metadata.register and not step.metadata.expect
        computed += step.output.num_scheduled_tokens.get(r.request_id, 0)
    assert r.status.name == "FINISHED_LENGTH_CAPPED" and computed >= len(PROMPT) - 2 * BLOCK
    assert d.free_blocks == free and not d.side.legs


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "fail"])
def test_a_quarantined_load_goes_on_at_once_while_its_blocks_stay_out_of_vllms_pool_until_released(recompute):
    """P is gone: the worker reports the load failed now and holds its blocks in quarantine (a write
    from a P that was only paused may still land). vLLM computes the prompt in fresh blocks, or
    fails it, at once; the registered blocks go back to its pool only when the worker releases them."""
    d = Engine("decode", recompute=recompute)
    free = d.free_blocks
    r = d.add(PROMPT, push_d(f"quarantined-{recompute}#0"), max_tokens=2)
    (registered,) = d.step().metadata.register
    quarantined = set(registered.block_ids)
    d.step(failed={r.request_id}, held={r.request_id})
    assert d.connector.has_pending_push_work() is True
    assert [len(q.blocks) for q in d.side.quarantine.values()] == [3]
    for _ in range(6):
        d.step()
        assert not quarantined & set(d.blocks_of(r.request_id)), "recomputed into quarantined blocks"
    assert r.status.name == ("FINISHED_LENGTH_CAPPED" if recompute else "FINISHED_ERROR")
    assert d.free_blocks == free - len(quarantined), "the quarantined blocks went back to vLLM's pool"
    other = d.add(OTHER, None, max_tokens=1)
    d.step()
    assert not quarantined & set(d.blocks_of(other.request_id)), "another request got a quarantined block"
    d.step(released={r.request_id})
    for _ in range(3):
        d.step()
    assert d.free_blocks == free and not d.side.legs and not d.side.quarantine
    assert d.connector.has_pending_push_work() is False


def test_a_quarantined_load_after_a_local_prefix_hit_is_computed_whole_in_fresh_blocks():
    """D held the prompt's first blocks in its prefix cache and registered only the rest: vLLM older
    than 0.32 would keep the hit and compute the rest into the very blocks P may still write."""
    d = Engine("decode")
    warm = d.add(PROMPT[:2 * BLOCK], None, max_tokens=1)
    for _ in range(3):
        d.step()
    assert warm.status.name == "FINISHED_LENGTH_CAPPED"
    r = d.add(PROMPT, push_d("quarantined-hit#0"), max_tokens=2)
    (registered,) = d.step().metadata.register
    assert registered.first_block_index == 2, "the hit was not local"
    quarantined = set(registered.block_ids)
    d.step(failed={r.request_id}, held={r.request_id})
    for _ in range(6):
        d.step()
        assert not quarantined & set(d.blocks_of(r.request_id)), "recomputed into quarantined blocks"
    assert r.status.name == "FINISHED_LENGTH_CAPPED"
    d.step(released={r.request_id})
    assert not d.side.quarantine


def test_quarantined_blocks_released_before_vllm_heard_of_the_failure_are_never_held():
    """Two workers: one released before the other reported its part of the load; nothing waits."""
    d = Engine("decode")
    free = d.free_blocks
    r = d.add(PROMPT, push_d("released-early#0"), max_tokens=1)
    d.step()
    d.step(held={r.request_id}, released={r.request_id})
    d.step(failed={r.request_id})
    for _ in range(4):
        d.step()
    assert not d.side.quarantine and d.free_blocks == free


def test_a_pull_decode_leg_reads_the_offer_for_its_own_prompt():
    d = Engine("decode")
    offers = [base64.b64encode(b"offer one").decode(), base64.b64encode(b"offer two").decode()]
    params = kv_params.pull_decode(signer(), "pull-d#0", [{"offer": o} for o in offers])
    r = d.add(PROMPT, params)
    (read,) = d.step().metadata.read
    assert read.allocated.request_id == r.request_id and read.offers == (b"offer one", b"offer two")
    d.step(loaded={r.request_id})
    for _ in range(6):
        d.step()
    assert r.status.name == "FINISHED_LENGTH_CAPPED" and not d.side.legs


def test_a_loaded_request_preempted_by_vllm_recomputes_locally_and_asks_p_for_nothing():
    d = Engine("decode", blocks=9, max_batched_tokens=512)  # room for one request and a bit
    first, second = d.add(PROMPT, push_d("pre-a#0"), max_tokens=60), d.add(OTHER, push_d("pre-b#0"), max_tokens=60)
    step = d.step()
    loads = [a.request_id for a in step.metadata.register]
    d.step(loaded=set(loads))
    preempted = False
    for _ in range(200):
        step = d.step(loaded={r.request_id for r in (first, second) if r.status.name == "WAITING_FOR_REMOTE_KVS"
                              and r.request_id not in loads})
        loads += [a.request_id for a in step.metadata.register]
        preempted |= bool(step.output.preempted_req_ids) if hasattr(step.output, "preempted_req_ids") else False
        preempted |= any(r.num_preemptions for r in (first, second))
        if first.is_finished() and second.is_finished():
            break
    assert first.is_finished() and second.is_finished()
    assert preempted, "the test's cache was meant to force a preemption"
    assert sorted(loads) == sorted({first.request_id, second.request_id})  # each registered once
    assert not d.side.legs and d.free_blocks == 9 - 1  # vLLM keeps one null block


def test_a_push_prefill_is_handed_to_the_writer_with_its_forward_and_held_until_sent():
    p = Engine("prefill")
    free = p.free_blocks
    r = p.add(PROMPT, prefill("push-p#0"), max_tokens=1)
    first = p.step().metadata
    if p.async_scheduling:  # the writer plans during the forward; the hand-off follows next step
        (coming,) = first.kv_coming
        assert coming.request_id == r.request_id and not first.kv_ready_after_forward
        (ready,) = p.step().metadata.kv_ready
    else:
        (ready,) = first.kv_ready_after_forward  # after the forward that computed the prompt
    assert ready.request_id == r.request_id and len(ready.block_ids) == 3
    assert r.is_finished() and p.connector.has_pending_push_work()
    assert p.free_blocks == free - 3  # vLLM keeps them for the writer (delay_free)
    p.step()
    assert p.free_blocks == free - 3
    p.step(sent={r.request_id})
    assert p.free_blocks == free and not p.connector.has_pending_push_work() and not p.side.legs


def test_a_chunked_prefill_hands_over_every_chunks_blocks():
    p = Engine("prefill", max_batched_tokens=32)
    long = list(range(500, 600))  # 100 tokens: four chunks of at most 32
    r = p.add(long, prefill("chunked-p#0"), max_tokens=1)
    (ready,) = p.hand_offs(steps=6)
    assert list(ready.block_ids) == p.blocks_of(r.request_id)[:7] and len(ready.block_ids) == 7
    p.step(sent={r.request_id})
    assert not p.side.legs


def test_a_chunked_push_prefill_streams_each_steps_finished_blocks_and_holds_nothing_until_its_end():
    p = Engine("prefill", max_batched_tokens=32)
    r = p.add(list(range(500, 600)), prefill("streamed-p#0"), max_tokens=1)  # 100 tokens: 4 steps
    chunks, handed = [], []
    for _ in range(6):
        meta = p.step().metadata
        chunks += meta.chunks_after_forward
        handed += meta.kv_ready_after_forward + meta.kv_ready
        if not r.is_finished():  # streaming holds no block of vLLM's: nothing for the engine loop to wait on
            assert not p.connector.has_pending_push_work()
    blocks = tuple(p.blocks_of(r.request_id))
    assert [c.block_ids for c in chunks] == [blocks[:2], blocks[:4], blocks[:6]]
    (ready,) = handed
    assert ready.block_ids == blocks[:7] and p.connector.has_pending_push_work()
    # vLLM 0.34 asks whether a preempted hand-off must be recomputed: a producer's must.
    assert getattr(p.connector, "requires_kv_delivery", True) is True
    p.step(sent={r.request_id})
    assert not p.side.legs


def test_a_streaming_prefill_vllm_preempts_for_lack_of_blocks_is_reported_and_sent_whole_at_its_end():
    p = Engine("prefill", blocks=9, max_batched_tokens=32)  # 8 usable: the two requests need 9
    grower = p.add(list(range(300, 316)), None, max_tokens=60)  # a plain request that keeps decoding
    r = p.add(list(range(500, 600)), prefill("preempted-p#0"), max_tokens=1)
    streamed, preempted, handed = [], [], []
    for _ in range(120):
        meta = p.step().metadata
        if meta is not None:
            streamed += meta.chunks_after_forward
            preempted += meta.preempted
            handed += meta.kv_ready_after_forward + meta.kv_ready
        if handed:
            break
    assert streamed, "the prefill was meant to stream before vLLM preempted it"
    assert preempted == [p.side.legs[r.request_id].key]
    (ready,) = handed  # computed again in full, and handed over whole at its end
    assert ready.block_ids == tuple(p.blocks_of(r.request_id))[:7]
    assert grower.is_finished() or p.blocks_of(grower.request_id)


def test_prefill_samples_of_one_prompt_send_its_kv_once_and_free_the_others_at_once():
    p = Engine("prefill")
    free = p.free_blocks
    params = prefill("siblings-p#0")
    first, second = p.add(PROMPT, params, max_tokens=1), p.add(PROMPT, params, max_tokens=1)
    handed = p.hand_offs(steps=3)
    assert [h.request_id for h in handed] == [first.request_id]
    assert second.is_finished() and p.free_blocks == free - 3  # only the first one's are held
    p.step(sent={first.request_id})
    assert p.free_blocks == free and not p.side.legs


def test_a_prefill_aborted_before_its_forward_frees_everything_and_tells_the_writer():
    p = Engine("prefill")
    free = p.free_blocks
    r = p.add(PROMPT, prefill("abort-p#0"), max_tokens=1)
    p.abort(r)
    p.step()
    assert p.free_blocks == free and not p.side.legs and not p.connector.has_pending_push_work()


def test_a_pull_prefill_answers_with_a_signed_offer_and_lends_its_blocks():
    p = Engine("prefill")
    rank = RankRegions(0, "engine-rank0", ())
    p.connector.set_xfer_handshake_metadata({0: RankHandshake(rank)})
    free = p.free_blocks
    r = p.add(PROMPT, prefill("pull-p#0", "pull"), max_tokens=1)
    p.step()
    step = p.step()
    (lend,) = step.metadata.lend
    assert lend.request_id == r.request_id and lend.offer.ranks == (rank,) and len(lend.offer.block_ids) == 3
    assert set(p.side.offered[lend.transfer_id]) == {"neuron_disagg", "offer"}
    assert p.free_blocks == free - 3
    p.step(sent={r.request_id})
    assert p.free_blocks == free and not p.side.legs


#: What llm-d's routing sidecar (llm-d/llm-d-router, pkg/sidecar/proxy/connector_nixlv2.go) puts on P's leg.
SIDECAR_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}


def lending_p(**extra) -> Engine:
    p = Engine("prefill", extra=extra)
    p.connector.set_xfer_handshake_metadata({0: RankHandshake(RankRegions(0, "engine-rank0", ()))})
    return p


def test_a_sidecars_prefill_leg_is_lent_and_answered_with_ds_whole_signed_params_where_p_accepts_them():
    """llm-d's sidecar hands P's answer to D verbatim: P answers with the pull decode params our
    router would write, signed by P; samples of one prompt (vLLM names them "<i>_<id>") share it."""
    p = lending_p(accept_unsigned_prefill_legs=True)
    free = p.free_blocks
    first = p.add(PROMPT, SIDECAR_PREFILL, max_tokens=1, request_id="cmpl-uuid1-0")
    sample = p.add(PROMPT, SIDECAR_PREFILL, max_tokens=1, request_id="1_cmpl-uuid1-0")
    p.step()
    step = p.step()
    (lend,) = step.metadata.lend  # one offer for the prompt, whichever sample ends first
    assert lend.transfer_id.request == "ext-cmpl-uuid1-0" and p.free_blocks == free - 3
    answers = [p.side.offered[lend.transfer_id]]
    parsed = kv_params.parse(answers[0], signer())
    assert (parsed.role, parsed.mode, parsed.transfer_id.request) == ("decode", "pull", "ext-cmpl-uuid1-0")
    assert base64.b64decode(parsed.offers[0])  # the signed offer frame D's reader verifies
    assert {first.status.name, sample.status.name} == {"FINISHED_LENGTH_CAPPED"}
    p.step(sent={lend.request_id})
    assert p.free_blocks == free and not p.side.legs


def test_a_sidecars_prefill_leg_runs_plain_where_p_does_not_accept_unsigned_legs():
    p = lending_p()
    free = p.free_blocks
    p.add(PROMPT, SIDECAR_PREFILL, max_tokens=1)
    p.step()
    step = p.step()
    assert not step.metadata.lend and not p.side.legs and p.free_blocks == free


def test_kv_cache_access_asks_for_one_allocation_per_segment_where_vllm_asks():
    """vLLM 0.34's extensible KV cache lets a segment span several physical allocations unless the
    connector says it registers the memory (RDMA): vLLM's own resolution, given our class."""
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(kv_connector="NeuronDisaggConnector", kv_role="kv_consumer",
                              kv_connector_module_path="neuron_disagg.vllm.connector", kv_buffer_device="cpu")
    asks = getattr(config, "registers_kv_cache_memory", None)
    if asks is None:  # before 0.34: vLLM allocates each layer's KV in one piece and asks nothing
        assert compat.registers_kv_cache() is None
        return
    assert asks() is True
    assert int(config.kv_cache_access()) == int(compat.registers_kv_cache())


@pytest.mark.parametrize("mode", ["vllm-push", "vllm-pull"])
def test_the_reference_modes_name_vllms_own_push_and_pull_connectors_in_this_vllm(mode):
    """The bench's and the router's vllm-push / vllm-pull modes configure vLLM's own connectors by
    name; in each vLLM the name must resolve to its NIXL push or pull connector (0.34 also maps
    NixlConnector plus a transfer_mode onto them; the names we use resolve without it)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from neuron_disagg.local_cluster import REFERENCE_CONNECTORS

    config = KVTransferConfig(kv_connector=REFERENCE_CONNECTORS[mode], kv_role="kv_producer", kv_buffer_device="cpu")
    resolved = KVConnectorFactory.get_connector_class(config).__name__
    assert resolved.startswith("Nixl") and ("Push" in resolved) == (mode == "vllm-push"), resolved
