"""The one module that knows vLLM versions (neuron_disagg/vllm/compat.py), against the vLLM installed
in this environment: tests/test_vllm_versions.py runs this file in every vLLM environment CI builds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from neuron_disagg.platforms.kv_layout import BLOCKS, HEAD, HEADS, KV, TOKENS  # noqa: E402
from neuron_disagg.vllm import compat  # noqa: E402
from neuron_disagg.vllm.connector import NeuronDisaggConnector, StepClock, _refuse_hybrid_kv_cache  # noqa: E402
from neuron_disagg.vllm.neuron_plugin import UnsupportedNeuronPlugin, refuse_unsupported_platform  # noqa: E402
from neuron_disagg.vllm.decode import DecodeScheduler, DecodeState  # noqa: E402
from neuron_disagg.vllm.prefill import PrefillScheduler  # noqa: E402
from neuron_disagg.kv_params import ParamsSigner  # noqa: E402

VERSION = compat.parse(vllm.__version__)


def test_the_installed_vllm_is_in_range_and_its_connector_api_is_the_one_we_use():
    assert compat.check_runtime() == vllm.__version__
    assert compat.api_differences(KVConnectorBase_V1) == []
    assert compat.OLDEST <= VERSION and VERSION[:2] <= compat.NEWEST_TESTED


@pytest.mark.parametrize("version,refused", [
    ("0.13.9", "CVE-2026-22807"), ("0.21.0", "older than neuron-disagg supports"), ("0.23.1+cpu", "0.24.0 – 0.34.x")])
def test_versions_below_the_range_are_refused_naming_it(version, refused):
    with pytest.raises(compat.UnsupportedVLLM, match=refused):
        compat.check_version(version)


def test_versions_in_range_pass_and_newer_ones_are_flagged_for_the_api_check():
    assert compat.check_version("0.24.0") is False
    assert compat.check_version("0.32.0+cpu") is False
    assert compat.check_version("0.34.2") is False
    assert compat.check_version("0.35.0") is True


def test_a_changed_connector_api_is_named():
    def request_finished(self, request, block_ids_by_group):  # a renamed parameter
        return False, None

    methods = {name: getattr(KVConnectorBase_V1, name) for name in compat.API if name != "get_finished"}
    differences = compat.api_differences(type("Changed", (), {**methods, "request_finished": request_finished}))
    assert any(d.startswith("get_finished is gone") for d in differences)
    assert any("request_finished" in d and "block_ids_by_group" in d for d in differences)
    assert len(differences) == 2


def test_failed_loads_are_reported_the_way_this_vllm_takes_them():
    """0.32+: by request id in KVConnectorTransferResults.failed_recving; older: the scheduler learns
    them from invalid_block_ids, which the worker fills with the failed loads' blocks."""
    assert compat.reports_failed_recving() == (VERSION >= (0, 32, 0))
    results = compat.transfer_results({"p"}, {"a", "b"}, {"b"})
    assert (results.finished_sending, results.finished_recving, results.failed_recving) == ({"p"}, {"a", "b"}, {"b"})
    output = SimpleNamespace(failed_recving={"b"}, invalid_block_ids={7})
    registered = {"a": (3, 4), "b": (7, 8)}
    assert compat.failed_loads(output, registered) == {"b"}


def test_older_vllm_gets_a_failed_load_as_its_blocks(monkeypatch):
    """get_finished (what vLLM < 0.32 calls) keeps a failed load in finished_recving and hands its
    blocks to get_block_ids_with_load_errors, once."""
    class Worker:
        failed_blocks = {7, 8}
        step_us: list = []
        step_cpu_us: list = []

        def transfer_results(self, finished):
            return set(), {"a", "b"}, {"b"}

        def wait_for_landing(self):
            pass

    connector = object.__new__(NeuronDisaggConnector)
    connector.worker_side, connector._step, connector._connector_metadata = Worker(), StepClock(), None
    connector._failed_blocks = set()
    assert connector.get_finished(set()) == (None, {"a", "b"})
    assert connector.get_block_ids_with_load_errors() == {7, 8}
    assert connector.get_block_ids_with_load_errors() == set()


class FakeRequest(SimpleNamespace):
    pass


SIGNER = ParamsSigner(b"compat-tests-deployment-secret-0123")


def test_scheduler_side_fails_a_load_from_invalid_blocks_on_older_vllm(monkeypatch):
    monkeypatch.setattr(compat, "reports_failed_recving", lambda: False)
    side = DecodeScheduler(16, SIGNER)
    params = SIGNER.sign({"neuron_disagg": 1, "role": "decode", "mode": "push", "transfer_id": "r#0",
                          "p_side_channel": "127.0.0.1:1", "p_tp_size": 1})
    request = FakeRequest(request_id="d1", prompt_token_ids=list(range(40)), kv_transfer_params=params)
    assert side.get_num_new_matched_tokens(request, 0) == (40, True)
    side.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(b, ref_cnt=1) for b in (5, 6, 9)],)), 40)
    side.update_connector_output(SimpleNamespace(finished_recving={"d1"}, finished_sending=set(),
                                                 invalid_block_ids={6}))
    assert side.legs["d1"].state is DecodeState.FAILED
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)  # vLLM recomputes or fails it


def test_prefill_hands_the_writer_only_the_prompts_blocks():
    """vLLM 0.24 passes request_finished every block of the request, later versions those of its
    computed tokens: either way only the prompt's blocks carry KV for D."""
    side = PrefillScheduler(16, SIGNER)
    params = SIGNER.sign({"neuron_disagg": 1, "role": "prefill", "mode": "push", "transfer_id": "r#0"})
    request = FakeRequest(request_id="p1", prompt_token_ids=list(range(40)), kv_transfer_params=params,
                          status="FINISHED_LENGTH_CAPPED")
    side.get_num_new_matched_tokens(request, 0)
    assert side.request_finished(request, [11, 12, 13, 14]) == (True, None)
    (ready,) = side.build_connector_meta(None).kv_ready
    assert ready.block_ids == (11, 12, 13)


def test_the_nxdi_neuron_plugin_is_refused_naming_the_supported_one():
    nxdi = type("NeuronPlatform", (), {"__module__": "vllm_neuron.platform"})()
    native = type("NeuronPlatform", (), {"__module__": "vllm_neuron.vllm.platform"})()
    with pytest.raises(UnsupportedNeuronPlugin, match="NxD Inference.*SDK 2.32 or newer"):
        refuse_unsupported_platform(nxdi)
    refuse_unsupported_platform(native)
    refuse_unsupported_platform()  # this process's own platform (CPU) passes


def test_a_hybrid_kv_cache_is_refused_with_the_flag_that_avoids_it():
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager"):
        _refuse_hybrid_kv_cache(SimpleNamespace(kv_cache_groups=[object(), object()]))
    _refuse_hybrid_kv_cache(SimpleNamespace(kv_cache_groups=[object()]))


class NeuronAttentionBackend:
    """Stand-in with the Neuron plugin's declaration (vllm-project/vllm-neuron
    vllm_neuron/vllm/attention/attn.py@39927070: "# HND layout")."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, num_kv_heads, block_size, head_size)


def test_declared_shapes_are_read_by_probing_not_by_guessing():
    assert compat.backend_dims(NeuronAttentionBackend) == (KV, BLOCKS, HEADS, TOKENS, HEAD)

    class Odd:  # a shape with a dimension that is none of ours (a padded head, say)
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            return (num_blocks, block_size, num_kv_heads, head_size + 4)

    with pytest.raises(compat.UnsupportedVLLM, match="Odd's KV cache shape cannot be read"):
        compat.backend_dims(Odd)
