"""Real P and D processes whose wall clocks disagree (an offset injected into one of them): within
the allowance transfers go on; beyond it the side whose clock is behind refuses to act on the
other's deadlines, so nothing is written or read after the other side's fence, and the request
fails at once with both clocks in its reason (vLLM then recomputes it)."""

import time

import pytest

from .test_push_faults import _deliver

pytestmark = pytest.mark.integration
SKEW_ALLOWANCE_S = 0.2  # what peer.py runs with


def test_prefill_behind_decode_refuses_the_registration_and_writes_nothing(ucx_peers):
    p = ucx_peers("prefill", "--clock-offset-s", "-5", "--lease-s", "30")
    d = ucx_peers("decode", "--watchdog-s", "20")
    tid = ["skewed", 0]
    p.call("fill", blocks=[1, 2], seed=1)
    before = d.call("digest", blocks=[3, 4])["digest"]
    d.call("expect", tid=tid, p_address=p.address)
    started = time.monotonic()
    d.call("allocate", tid=tid, blocks=[3, 4])
    p.call("kv_ready", tid=tid, blocks=[1, 2])
    failed = d.event_for("failed", tid, timeout=10)
    assert time.monotonic() - started < 5, "D must not wait out its 20 s watchdog"
    assert "prefill's clock" in failed["reason"] and "behind decode's" in failed["reason"]
    assert sorted(d.event_for("free", tid, timeout=10)["blocks"]) == [3, 4]
    stats = p.call("stats")
    assert stats["counters"]["dropped:registration:clock_behind"] == 1
    assert stats["writer"].get("bytes", 0) == 0 and stats["writer"].get("writes", 0) == 0
    assert d.call("digest", blocks=[3, 4])["digest"] == before  # nothing landed


def test_decode_behind_prefill_refuses_the_offer_and_reads_nothing(ucx_peers):
    p = ucx_peers("prefill", "--mode", "pull", "--lease-s", "30")
    d = ucx_peers("decode", "--mode", "pull", "--clock-offset-s", "-5")
    tid = ["skewed", 0]
    p.call("fill", blocks=[1, 2], seed=1)
    before = d.call("digest", blocks=[3, 4])["digest"]
    offer = p.call("lend", tid=tid, blocks=[1, 2])["offer"]
    d.call("offered", tid=tid, offer=offer)
    d.call("allocate", tid=tid, blocks=[3, 4])
    failed = d.event_for("failed", tid, timeout=10)
    assert "decode's clock" in failed["reason"] and "behind prefill's" in failed["reason"]
    assert sorted(d.event_for("free", tid, timeout=10)["blocks"]) == [3, 4]
    assert sorted(p.event_for("free", tid, timeout=10)["blocks"]) == [1, 2]  # D told P: no lease wait
    assert d.call("digest", blocks=[3, 4])["digest"] == before


@pytest.mark.parametrize("offset_s", [-SKEW_ALLOWANCE_S / 2, 5.0])
def test_clocks_within_the_allowance_or_prefill_ahead_still_deliver(ucx_peers, offset_s):
    p = ucx_peers("prefill", "--clock-offset-s", str(offset_s), "--lease-s", "30")
    d = ucx_peers("decode", "--watchdog-s", "20")
    _deliver(p, d, ["fine", 0], [1, 2], [3, 4], seed=2)
