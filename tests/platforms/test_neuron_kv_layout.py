"""The vLLM Neuron plugin's KV, as recorded from its source (fixtures/neuron_plugin_kv.json: shape,
block size, dtype, layer names, device type; repository and path cited there), through the same
byte-exact checks as vLLM's own backends (tests/vllm/test_kv_layouts.py).

The plugin keeps one tensor per layer, ``(2, blocks, heads, tokens, head)``: K and V planes, each
block head-major. Read as the older token-major ``(2, blocks, tokens, heads, head)`` — what the
connector assumed before — any P TP other than D's sent the wrong bytes; now such a reading is
refused at start-up (checked below). The tensors here are CPU memory; the native ``neuron`` device and its fence are tested in
test_cuda.py and tests/transfer/test_threads.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch's CPU build is installed with vLLM by scripts/setup.sh")

from neuron_disagg.platforms.kv_layout import HEADS, KV, TOKENS, KVGeometry, UnsupportedKVLayout, regions_from_kv_caches  # noqa: E402
from neuron_disagg.vllm.compat import backend_dims  # noqa: E402

from .. import kv_bytes  # noqa: E402

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "neuron_plugin_kv.json").read_text())
DECLARED = tuple(FIXTURE["declaration"]["dims"])


class NeuronAttentionBackend:
    """The plugin's declaration, as recorded (FIXTURE["declaration"])."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        sizes = {"kv": 2, "blocks": num_blocks, "heads": num_kv_heads, "tokens": block_size, "head": head_size}
        return tuple(sizes[d] for d in DECLARED)


def builder(case: dict):
    blocks = case.get("test_num_blocks", case["num_blocks"])
    layers = [f"layers.{i}.self_attn" for i in range(case["layers"])]
    dtype = getattr(torch, case["dtype"])

    def build(heads: int) -> tuple[dict, int]:
        sizes = {"kv": 2, "blocks": blocks, "heads": heads, "tokens": case["block_size"], "head": case["head_size"]}
        return {name: torch.zeros(tuple(sizes[d] for d in DECLARED), dtype=dtype) for name in layers}, case["block_size"]
    return build, blocks


def test_the_plugins_declaration_is_read_as_head_major_planes():
    assert backend_dims(NeuronAttentionBackend) == DECLARED == (KV, "blocks", HEADS, TOKENS, "head")
    assert FIXTURE["platform"]["device_type"] == "neuron" and FIXTURE["platform"]["default_block_size"] == 32


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["name"][:24])
@pytest.mark.parametrize("d_tp_factor", [1, 2, 0.5], ids=["same-tp", "twice-the-tp", "half-the-tp"])
def test_the_plugins_kv_lands_byte_exact(case, d_tp_factor):
    build, blocks = builder(case)
    p_tp, d_tp = case["tp"], int(case["tp"] * d_tp_factor)
    kv_bytes.transfer(build, build, backend_dims(NeuronAttentionBackend), DECLARED, case["block_size"],
                      p_tp, d_tp, case["total_kv_heads"], blocks)


def test_declared_as_a_shape_guess_read_it_the_tensors_are_refused_not_planned():
    """A 5-D tensor read as (2, blocks, tokens, heads, head): its 4 heads per rank taken for tokens
    and its 32 tokens for heads. Planned that way, heads of P TP 2 sliced for D TP 4 came from the
    wrong bytes (measured on the code before 2026-11-30); now the sizes contradict the rank's heads
    and start-up stops (here: 2 "tokens" per block cannot tile the scheduler's 32-token blocks)."""
    case = FIXTURE["cases"][0]
    build, _ = builder(case)
    caches, _ = build(2)
    guessed = (KV, "blocks", TOKENS, HEADS, "head")
    with pytest.raises(UnsupportedKVLayout, match="layers.0.self_attn"):
        regions_from_kv_caches(caches, dict.fromkeys(caches, guessed), KVGeometry(case["block_size"], 0, 2, 4))
