"""`neuron-disagg demo` as the README runs it, and what makes its verdict mean something: with one
pushed block corrupted on D (a fault injected into D's processes through its environment), the
demo reports the mismatch and fails. Its reference is D computing the prompt under a cache salt:
without it, the reference would read most of the transferred KV back from D's own prefix cache
and so compare that KV largely with itself."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

pytestmark = [pytest.mark.integration, pytest.mark.vllm_servers]

# Loaded by every Python process of D (PYTHONPATH): fills the first destination block of the first
# KV region with 0x7f bytes as soon as a transfer lands, before vLLM is told the KV is there.
CORRUPT_ONE_BLOCK = '''
import ctypes
from neuron_disagg.vllm.decode import DecodeWorker

_hand_off, _loaded = DecodeWorker.hand_off, DecodeWorker._loaded


def hand_off(self, step):
    blocks = self.__dict__.setdefault("_test_blocks", {})
    for reg in step.register:
        blocks[reg.transfer_id] = reg.block_ids
    for read in step.read:
        blocks[read.allocated.transfer_id] = read.allocated.block_ids
    return _hand_off(self, step)


def loaded(self, tid, record):
    for block in self.__dict__.get("_test_blocks", {}).pop(tid, ())[:1]:
        region = self.rank.regions[0]
        ctypes.memset(region.base_addr + block * region.block_stride_bytes, 0x7F, region.block_stride_bytes)
    return _loaded(self, tid, record)


DecodeWorker.hand_off, DecodeWorker._loaded = hand_off, loaded
'''


def _demo(**kwargs) -> tuple[int, str]:
    pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")
    from neuron_disagg.demo.served import run_demo

    out = io.StringIO()
    rc = run_demo(Console(file=out, width=200), **kwargs)
    return rc, out.getvalue()


def test_the_demo_passes():
    rc, out = _demo()
    assert rc == 0, out
    assert out.count("same tokens as D computing alone") == 6 and "all answers matched" in out


@pytest.mark.extended  # a second P and D (about 2.5 min in CI's run): scripts/extended.sh runs it
def test_a_corrupted_pushed_block_makes_the_demo_fail(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(CORRUPT_ONE_BLOCK)
    rc, out = _demo(decode_env={"PYTHONPATH": str(tmp_path)})
    assert rc == 1, out
    assert "DIFFERS from D alone" in out and "demo did not pass" in out
