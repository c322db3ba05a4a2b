"""The prefix index: what each instance holds, from vLLM's KV events, and how much of a prompt each
would hit (``router/prefix_index.py``)."""

from __future__ import annotations

import json
import subprocess

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_disagg.router.prefix_index import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                               PrefixIndex)
from tests.vllm_envs import REPO, extra_env, main_env

BLOCK = 4


def batch(*events) -> bytes:
    return msgspec.msgpack.encode(EventBatch(1.0, [msgspec.Raw(msgspec.msgpack.encode(e)) for e in events]))


def stored(hashes, parent, tokens, **kw) -> BlockStored:
    return BlockStored(list(hashes), parent, list(tokens), BLOCK, **kw)


PROMPT = list(range(100, 114))  # three full blocks and two tokens


def test_a_prompt_hits_the_leading_blocks_an_instance_stored_and_loses_those_it_removed():
    index = PrefixIndex(BLOCK)
    keys = index.keys_of(PROMPT)
    assert len(keys) == 3  # no partial block
    # vLLM 0.32 sends one extra key per block, None where a block has none
    assert index.apply("d0", batch(stored([b"a", b"b"], None, PROMPT[:8], extra_keys=[None, None]))) == 1
    index.apply("d0", batch(stored([b"c"], b"b", PROMPT[8:12])))
    assert (index.hit_blocks("d0", keys), index.hit_blocks("d1", keys)) == (3, 0)
    assert index.hit_blocks("d0", index.keys_of([0] + PROMPT[1:])) == 0  # one token off: the chain differs
    index.apply("d0", batch(BlockRemoved([b"b"])))
    assert index.hit_blocks("d0", keys) == 1  # the chain breaks at the removed block
    index.apply("d0", batch(AllBlocksCleared()))
    assert index.hit_blocks("d0", keys) == 0 and index.blocks("d0") == 0


def test_forged_or_malformed_events_are_rejected_and_counted_and_nothing_else_is_lost():
    index = PrefixIndex(BLOCK)
    index.apply("d0", batch(stored([b"a"], None, PROMPT[:4])))
    assert index.apply("d0", b"\x93not msgpack") == 0
    assert index.apply("d0", msgspec.msgpack.encode([1.0, [{"type": "BlockReused", "x": 1}]])) == 0
    assert index.apply("d0", batch(stored([b"x", b"y"], None, PROMPT[:4]))) == 0  # 2 blocks, 1 block's tokens
    assert index.apply("d0", batch(BlockStored([b"x"], None, PROMPT[:8], 8))) == 0  # another block size
    assert index.apply("d0", batch(stored([b"z"], b"never-seen", PROMPT[4:8]))) == 0
    assert index.apply("d0", batch(stored([b"l"], None, PROMPT[:4], lora_name="adapter"))) == 0
    assert index.apply("d0", batch(stored([b"s"], None, PROMPT[:4], extra_keys=[["salt"]]))) == 0
    assert index.rejected == {"malformed": 1, "unknown_event": 1, "bad_event": 2, "unknown_parent": 1,
                              "not_indexed": 2}
    assert index.hit_blocks("d0", index.keys_of(PROMPT)) == 1  # what it held before, still held


def test_no_sender_grows_an_instance_past_its_bound_and_the_oldest_blocks_go_first():
    index = PrefixIndex(BLOCK, max_blocks=8)
    for i in range(20):
        index.apply("d0", batch(stored([i], None, [i] * BLOCK)))
    assert index.blocks("d0") == 8
    assert index.hit_blocks("d0", index.keys_of([19] * BLOCK)) == 1
    assert index.hit_blocks("d0", index.keys_of([0] * BLOCK)) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 5)), max_size=40))
def test_the_index_holds_exactly_what_the_events_left_stored(ops):
    """Against a model: one chain of six blocks, stored block by block, removed, cleared in any order."""
    index = PrefixIndex(BLOCK)
    tokens = list(range(6 * BLOCK))
    keys = index.keys_of(tokens)
    held: set[int] = set()
    for op, i in ops:
        if op == "store":
            index.apply("d", batch(stored([i], None if i == 0 else i - 1, tokens[i * BLOCK:(i + 1) * BLOCK])))
            if i == 0 or i - 1 in held:
                held.add(i)
        elif op == "remove":
            index.apply("d", batch(BlockRemoved([i])))
            held.discard(i)
        else:
            index.apply("d", batch(AllBlocksCleared()))
            held.clear()
        expected = next(n for n in range(7) if n not in held)
        assert index.hit_blocks("d", keys) == expected


# The batch a vLLM engine publishes, built with that version's own classes and encoder.
_PUBLISHED = """
import json, sys, msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
tokens = list(range(100, 112))
fields = dict(lora_id=None, medium="GPU")
if "lora_name" in BlockStored.__struct_fields__:
    fields["lora_name"] = None
events = [BlockStored(block_hashes=[b"h0", b"h1"], parent_block_hash=None, token_ids=tokens[:8], block_size=4, **fields),
          BlockStored(block_hashes=[7], parent_block_hash=b"h1", token_ids=tokens[8:], block_size=4, **fields),
          BlockRemoved(block_hashes=[b"h1"], medium="GPU")]
first = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))
cleared = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=2.0, events=[AllBlocksCleared()]))
print(json.dumps([first.hex(), cleared.hex()]))
"""


@pytest.mark.integration  # a Python process per vLLM version
@pytest.mark.parametrize("version", ["main", "0.29.0", "0.34.0"])
def test_events_published_by_vllms_own_classes_are_read(version):
    env = main_env() if version == "main" else extra_env(version)
    out = subprocess.run([env.python, "-c", _PUBLISHED], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, cleared = (bytes.fromhex(h) for h in json.loads(out.stdout.strip().splitlines()[-1]))
    index = PrefixIndex(BLOCK)
    assert index.apply("d0", first) == 3 and not index.rejected
    keys = index.keys_of(list(range(100, 112)))
    assert index.hit_blocks("d0", keys) == 1  # h1 removed: h0 alone leads, the int-hashed third is cut off
    assert index.blocks("d0") == 2
    assert index.apply("d0", cleared) == 1 and index.blocks("d0") == 0
