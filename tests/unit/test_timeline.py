"""The per-transfer timeline: files from several processes merged, TP ranks reduced, and TTFT split
into segments that add up."""

from __future__ import annotations

import pytest

from neuron_disagg import timeline
from neuron_disagg.timeline import Timeline

PUSH = {"router_arrived": 100.0, "p_arrived": 100.002, "p_scheduled": 100.010, "d_arrived": 100.003,
        "d_allocated": 100.006, "p_registration": 100.008, "p_kv_ready": 100.050,
        "p_write_posted": 100.055, "d_notified": 100.070, "p_write_done": 100.072, "d_loaded": 100.080,
        "d_scheduled": 100.082, "router_first_byte": 100.100}


def write(tmp_path, name: str, tid: str, events: dict[str, float]) -> None:
    t = Timeline(tmp_path, name)
    for event, at in events.items():
        t.mark(tid, event, at)
    t.close()


def test_off_writes_nothing(tmp_path):
    timeline.OFF.mark("x#0", "p_arrived")
    Timeline(None, "router").mark("x#0", "p_arrived")
    assert not any(tmp_path.iterdir())


def test_push_breakdown_from_files_of_several_processes(tmp_path):
    router = {k: v for k, v in PUSH.items() if k.startswith("router")}
    write(tmp_path, "router", "a#0", router)
    write(tmp_path, "prefill", "a#0", {k: v for k, v in PUSH.items() if k.startswith("p_")})
    write(tmp_path, "decode", "a#0", {k: v for k, v in PUSH.items() if k.startswith("d_")})
    write(tmp_path, "router", "b#0", router)  # b never reached P: no breakdown
    loaded = timeline.load(tmp_path)
    assert loaded["a#0"] == pytest.approx(PUSH)
    parts = timeline.breakdown(loaded["a#0"])
    assert list(parts) == [*timeline.PUSH_SEGMENTS, "ttft"]
    assert parts["registration_wait"] == 0  # D registered before the prefill ended
    assert parts["prefill"] == pytest.approx(0.040) and parts["write"] == pytest.approx(0.015)
    assert parts["to_d_step"] == pytest.approx(0.002) and parts["first_token"] == pytest.approx(0.018)
    assert sum(v for k, v in parts.items() if k != "ttft") == pytest.approx(parts["ttft"]) == pytest.approx(0.1)
    assert timeline.breakdown(loaded["b#0"]) is None


def test_late_registration_is_waited_for_and_ranks_reduce_to_first_and_last(tmp_path):
    late = {**PUSH, "p_registration": 100.060, "p_write_posted": 100.062}
    write(tmp_path, "prefill-rank0", "a#0", late)
    # rank 1 saw the registration later and finished its write later: the transfer is as late as it
    write(tmp_path, "prefill-rank1", "a#0", {"p_registration": 100.061, "d_notified": 100.075,
                                              "p_arrived": 100.004})
    events = timeline.load(tmp_path)["a#0"]
    assert events["p_registration"] == 100.060 and events["d_notified"] == 100.075
    assert events["p_arrived"] == 100.002
    parts = timeline.breakdown(events)
    assert parts["registration_wait"] == pytest.approx(0.010)
    assert parts["to_writer"] == pytest.approx(0.002)


def test_pull_breakdown_and_cut_lines(tmp_path):
    pull = {"router_arrived": 10.0, "p_arrived": 10.001, "p_scheduled": 10.002, "p_kv_ready": 10.030,
            "d_arrived": 10.035, "d_allocated": 10.040, "d_read_posted": 10.041, "d_read_done": 10.060,
            "d_loaded": 10.065, "d_scheduled": 10.068, "router_first_byte": 10.080}
    write(tmp_path, "all", "p#0", pull)
    with open(tmp_path / "killed-1.jsonl", "ab") as f:
        f.write(b'["p#0","d_loaded",10.0')  # a process killed mid-line
    parts = timeline.breakdown(timeline.load(tmp_path)["p#0"])
    assert list(parts) == [*timeline.PULL_SEGMENTS, "ttft"]
    assert parts["handoff"] == pytest.approx(0.010) and parts["read"] == pytest.approx(0.020)
    assert parts["to_d_step"] == pytest.approx(0.003)
    assert parts["ttft"] == pytest.approx(0.080)


def test_a_connectors_per_prompt_transfers_join_the_routers_transfer(tmp_path):
    """The connector names each prompt's transfer by the router's id plus a prompt digest; the
    timeline files them under the router's id, so nothing parses ids back."""
    from neuron_disagg.protocol import TransferId

    router = {k: v for k, v in PUSH.items() if k.startswith("router")}
    write(tmp_path, "router", "req.7#0", router)
    per_prompt = TransferId("req.7", 0, prompt="3f2a9c0b11d4")
    write(tmp_path, "prefill", per_prompt, {k: v for k, v in PUSH.items() if k.startswith("p_")})
    write(tmp_path, "decode", per_prompt, {k: v for k, v in PUSH.items() if k.startswith("d_")})
    assert list(timeline.load(tmp_path)) == ["req.7#0"]
    assert timeline.breakdown(timeline.load(tmp_path)["req.7#0"])["ttft"] == pytest.approx(0.1)


def test_a_timeline_that_cannot_be_written_turns_off_instead_of_raising(tmp_path, caplog):
    """Transfer threads mark it: a full disk must not kill one (its transfers would never end)."""
    import os

    full = Timeline(tmp_path, "decode-rank0")
    (tmp_path / f"decode-rank0-{os.getpid()}.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    full.mark("a#0", "d_notified")
    full.mark("a#0", "d_loaded")
    assert not full.enabled
    assert [r.getMessage() for r in caplog.records if "timeline" in r.getMessage()] == [
        f"timeline decode-rank0 off: cannot write to {tmp_path} ([Errno 28] No space left on device)"]
    (tmp_path / "not-a-directory").write_text("")
    Timeline(tmp_path / "not-a-directory", "router").mark("b#0", "router_arrived")  # mkdir fails: no raise
