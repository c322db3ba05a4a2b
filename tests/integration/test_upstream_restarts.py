"""vllm-project/vllm#49238: a prefill pod restarted while decode held transfers with it crashed the
decode instance. Here a real P process is killed and started again on the same side-channel port,
with a new NIXL agent, while a real D holds a transfer with it: D ends that transfer within its
bound with a reason, gives its blocks back once, keeps running, and its next transfer with the
restarted P lands byte for byte. Push and pull, over UCX (what no fabric changes)."""

from __future__ import annotations

import time

import pytest

from neuron_disagg.local_cluster import free_port

pytestmark = pytest.mark.integration
WATCHDOG_S, MAX_WRITE_S, SKEW_S = 4.0, 1.0, 0.2  # room for a loaded machine: a probe decides first


def _restart(ucx_peers, p, *args):
    port = p.address.rsplit(":", 1)[1]
    p.kill()
    return ucx_peers("prefill", "--port", port, *args)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_vllm_49238_a_prefill_restarted_under_decodes_transfer(ucx_peers, mode):
    args = ("--mode", mode, "--lease-s", "30")
    p = ucx_peers("prefill", "--port", str(free_port()), *args)
    d = ucx_peers("decode", "--mode", mode, "--watchdog-s", str(WATCHDOG_S), "--max-write-s", str(MAX_WRITE_S),
                  "--suspect-after-s", "1.2")

    def deliver(p, tid, src, dst, seed):
        p.call("fill", blocks=src, seed=seed)
        if mode == "push":
            d.call("expect", tid=tid, p_address=p.address)
            d.call("allocate", tid=tid, blocks=dst)
            p.call("kv_ready", tid=tid, blocks=src)
        else:
            d.call("offered", tid=tid, offer=p.call("lend", tid=tid, blocks=src)["offer"])
            d.call("allocate", tid=tid, blocks=dst)
        d.event_for("loaded", tid)
        assert d.call("digest", blocks=dst)["digest"] == p.call("digest", blocks=src)["digest"]

    deliver(p, ["warm", 0], [1, 2], [3, 4], seed=1)  # D and P know each other's agents
    held = ["held", 0]
    if mode == "push":  # D registered; P restarts before its prefill ends
        d.call("expect", tid=held, p_address=p.address)
        d.call("allocate", tid=held, blocks=[5, 6])
        started = time.monotonic()  # D's bound runs from its allocation: a restart's start-up is not D's
        deadline = time.monotonic() + 10
        while p.call("stats")["live"] != 1:
            assert time.monotonic() < deadline, "P never got the registration"
            time.sleep(0.05)
        p = _restart(ucx_peers, p, *args)
    else:  # P offered; it restarts before D reads
        offer = p.call("lend", tid=held, blocks=[7, 8])["offer"]
        p = _restart(ucx_peers, p, *args)
        d.call("offered", tid=held, offer=offer)
        d.call("allocate", tid=held, blocks=[5, 6])
        started = time.monotonic()
    # Push: D's probe is refused while P is down, or answered by the new process as another
    # incarnation: the load is given up at once and the blocks wait for their fence. Pull: the
    # READ to the old agent fails.
    failed = d.wait_event(lambda e: e["event"] in ("failed", "quarantined") and e["tid"] == held, 20)
    if mode == "push":
        assert failed["event"] == "quarantined", failed
        assert "restarted" in failed["reason"] or "unreachable" in failed["reason"], failed  # not the watchdog
    freed = d.event_for("free", held, timeout=20)
    elapsed = time.monotonic() - started
    assert failed["reason"] and sorted(freed["blocks"]) == [5, 6]
    bound = WATCHDOG_S + 2 * MAX_WRITE_S + SKEW_S  # D's fence after its watchdog (push); a read: sooner
    assert elapsed < bound + 10, f"D took {elapsed:.1f} s, bound {bound} s"
    assert not [e for e in d.events if e.get("tid") == held and e.get("event") == "loaded"]
    deliver(p, ["after-restart", 0], [9, 10], [11, 12], seed=3)  # D lives on, and serves the new P
    assert d.call("stats")["outstanding_blocks"] == 0
