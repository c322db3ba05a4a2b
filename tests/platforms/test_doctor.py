"""`doctor --json` on this machine: passes when all is well, fails on a bad config or a busy port."""

from __future__ import annotations

import json
import socket

import pytest


from neuron_disagg import doctor

pytestmark = pytest.mark.integration  # doctor probes NIXL's backends in child processes

SECRET = "s" * 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(capsys, *argv):
    rc = doctor.main(["--json", *argv])
    return rc, json.loads(capsys.readouterr().out)


def _config(tmp_path, port: int, extra: str = "") -> str:
    path = tmp_path / "c.yaml"
    path.write_text(f"side_channel_port: {port}\n{extra}")
    return str(path)


def test_passes_here_with_secret(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", SECRET)
    rc, out = _run(capsys, "--config", _config(tmp_path, _free_port()))
    by = {c["name"]: c for c in out["checks"]}
    assert rc == 0 and out["ok"], [c for c in out["checks"] if c["status"] == "fail"]
    assert out["platform"] == "cpu" and out["nixl_backend"] == "UCX"
    assert by["nixl backend UCX"]["status"] == "ok"
    assert by["nixl backend LIBFABRIC"]["status"] in ("ok", "warn")
    assert by["secret"]["status"] == "ok" and SECRET not in json.dumps(out)
    assert all(set(c) == {"name", "status", "message", "fix"} for c in out["checks"])


def test_missing_secret_fails_with_a_fix(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NEURON_DISAGG_SECRET", raising=False)
    rc, out = _run(capsys, "--config", _config(tmp_path, _free_port()))
    secret = next(c for c in out["checks"] if c["name"] == "secret")
    assert rc != 0 and secret["status"] == "fail" and "openssl rand" in secret["fix"]


def test_the_plain_report_shows_each_check_and_the_fix_for_what_failed(tmp_path, capsys, monkeypatch):
    """Without --json doctor prints plain text: a vLLM environment has only the base install."""
    monkeypatch.delenv("NEURON_DISAGG_SECRET", raising=False)
    rc = doctor.main(["--config", _config(tmp_path, _free_port())])
    lines = capsys.readouterr().out.splitlines()
    secret = next(i for i, line in enumerate(lines) if line.split()[:2] == ["fail", "secret"])
    assert rc != 0 and "openssl rand" in lines[secret + 1] and lines[secret + 1].split()[0] == "fix:"
    assert any(line.split()[:2] == ["ok", "platform"] for line in lines)


def test_image_bake_passes_without_a_secret(tmp_path, capsys, monkeypatch):
    """The AMI's last step runs `doctor --image`: no deployment secret exists at bake time."""
    monkeypatch.delenv("NEURON_DISAGG_SECRET", raising=False)
    rc, out = _run(capsys, "--image", "--config", _config(tmp_path, _free_port()))
    secret = next(c for c in out["checks"] if c["name"] == "secret")
    assert rc == 0 and secret["status"] == "warn", [c for c in out["checks"] if c["status"] == "fail"]


def test_bad_config_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", SECRET)
    rc, out = _run(capsys, "--config", _config(tmp_path, 80, "lease_s: -1\n"))
    config = out["checks"][0]
    assert rc != 0 and not out["ok"] and config["name"] == "config" and config["status"] == "fail"
    assert "lease_s" in config["message"] and config["fix"]


def test_busy_side_channel_port_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", SECRET)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc, out = _run(capsys, "--config", _config(tmp_path, busy.getsockname()[1]))
    side = next(c for c in out["checks"] if c["name"] == "side channel")
    assert rc != 0 and side["status"] == "fail" and "side_channel_port" in side["fix"]


def test_table_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", SECRET)
    assert doctor.main(["--config", _config(tmp_path, _free_port())]) == 0
    assert "neuron-disagg doctor" in capsys.readouterr().out


def test_neuron_platform_wants_env_and_libfabric(monkeypatch):
    """On a Neuron host without the fabric variables, doctor fails with the exports to run."""
    from neuron_disagg.platforms.neuron import NeuronPlatform
    for k in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "FI_EFA_ENABLE_SHM_TRANSFER"):
        monkeypatch.delenv(k, raising=False)
    check = doctor.check_env(NeuronPlatform("/nonexistent"), "LIBFABRIC")
    assert check.status == "fail" and "export FI_PROVIDER=efa;" in check.fix
    monkeypatch.setattr(doctor, "probe_nixl", lambda image=False: {"UCX": "loaded", "LIBFABRIC": "nixlNotFoundError"})
    fab = [c for c in doctor.check_nixl("LIBFABRIC") if c.name == "nixl backend LIBFABRIC"][0]
    assert fab.status == "fail"
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout_s=20.0: None)
    assert doctor.check_libfabric("LIBFABRIC").status == "fail"
    assert doctor.check_libfabric("UCX").status == "ok"


CHRONY = """Reference ID    : A9FEA97B (169.254.169.123)
Stratum         : 4
System time     : {value} seconds {direction} of NTP time
Last offset     : -0.000012 seconds
Leap status     : Normal
"""


@pytest.mark.parametrize("value, direction, status", [
    ("0.000021", "slow", "ok"), ("0.400000", "fast", "ok"), ("0.600000", "slow", "fail"), ("2.5", "fast", "fail")])
def test_clock_offset_against_half_the_skew_allowance(monkeypatch, value, direction, status):
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout_s=20.0:
                        CHRONY.format(value=value, direction=direction) if cmd[0] == "chronyc" else None)
    check = doctor.check_clock(doctor.Config())
    assert check.status == status, check
    sign = "-" if direction == "slow" else "+"
    assert f"{sign}{float(value):.3f}" in check.message
    if status == "fail":
        assert "clock_skew_allowance_s" in check.message and "chronyd" in check.fix


def test_clock_without_chrony_asks_timedatectl(monkeypatch):
    answers = {"chronyc": None, "timedatectl": "yes\n"}
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout_s=20.0: answers[cmd[0]])
    assert doctor.check_clock(doctor.Config()).status == "ok"
    answers["timedatectl"] = "no\n"
    check = doctor.check_clock(doctor.Config())
    assert check.status == "warn" and "'no'" in check.message
