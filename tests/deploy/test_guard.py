"""A host that boots but cannot serve powers off, and max_hours holds across reboots: the guard
(ami/boot/guard.sh) run for real in a scratch root, against real HTTP servers on 127.0.0.1, with
stand-ins for what would power this machine off (shutdown, poweroff) or read a journal that is not
here (journalctl); the units' start limits and OnFailure= read as text and checked by systemd's own
`systemd-analyze verify` (systemd cannot run here, so no unit is started by it)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_disagg.deploy import user_data
from neuron_disagg.deploy.status import boot_failure
from neuron_disagg.local_cluster import free_port

from .conftest import wait_until_serving
from .test_user_data import REPO, deployment, env_file, render, run_script, shellcheck

pytestmark = pytest.mark.integration  # runs the guard and HTTP servers as processes

GUARD = REPO / "ami/boot/guard.sh"
UNITS = REPO / "ami/units"


def scratch(tmp_path: Path, *, booted_s_ago: float, serve_within_s: int, checks: list[str],
            stop_at: float | None = None, max_hours: str = "8") -> Path:
    """A root as the user data leaves it: the guard's settings, a boot time, a console."""
    root = tmp_path / "root"
    for directory in ("dev", "proc", "etc/neuron-disagg"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    (root / "dev/console").touch()
    (root / "proc/stat").write_text(f"btime {int(time.time() - booted_s_ago)}\n")
    (root / "etc/neuron-disagg/guard.env").write_text(
        f'SERVE_WITHIN_S={serve_within_s}\nCHECKS="{" ".join(checks)}"\n'
        f"STOP_AT={'' if stop_at is None else int(stop_at)}\nMAX_HOURS={max_hours}\n")
    return root


def stand_ins(tmp_path: Path, journal: str = "") -> Path:
    """shutdown and poweroff that record instead of powering this machine off; journalctl that
    answers ``journal``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "journal.txt").write_text(journal)
    scripts = {
        "shutdown": '#!/bin/bash\necho "$*" >> "$NEURON_DISAGG_ROOT/shutdown.log"\n',
        "poweroff": '#!/bin/bash\necho poweroff >> "$NEURON_DISAGG_ROOT/shutdown.log"\n',
        "journalctl": f'#!/bin/bash\necho "$*" >> "$NEURON_DISAGG_ROOT/journalctl.log"\ncat {tmp_path / "journal.txt"}\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def guard(root: Path, tmp_path: Path, *args: str, journal: str = "", timeout: float = 30) -> subprocess.CompletedProcess:
    env = {**os.environ, "NEURON_DISAGG_ROOT": str(root), "NEURON_DISAGG_GUARD_INTERVAL_S": "0.2",
           "PATH": f"{stand_ins(tmp_path, journal)}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(GUARD), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def health_server(tmp_path):
    """A real HTTP server answering /health with 200, as vLLM and the router do once serving."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "health").write_text("ok")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory",
                               str(site)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/health"
    wait_until_serving(url, server, 20, "local HTTP server")
    yield url
    server.terminate()
    server.wait(10)


def silent_url() -> str:
    return f"http://127.0.0.1:{free_port()}/health"  # nobody listens there


def console(root: Path) -> str:
    return (root / "dev/console").read_text()


def test_guard_passes_shellcheck():
    done = subprocess.run([shellcheck(), "-x", str(GUARD)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_a_host_not_serving_by_its_deadline_says_why_on_the_console_and_powers_off(tmp_path, health_server):
    silent = silent_url()
    root = scratch(tmp_path, booted_s_ago=3600, serve_within_s=1800, checks=[health_server, silent])
    done = guard(root, tmp_path, "watch", "--once")
    assert done.returncode == 0, done.stderr
    line = f"{user_data.FATAL_PREFIX} not serving 30 min after boot: no answer from {silent}"
    assert console(root).startswith(line), console(root)
    assert health_server not in console(root)  # the instance that answers is not blamed
    assert (root / "shutdown.log").read_text().startswith("-h now neuron-disagg: FATAL: not serving")


def test_before_its_deadline_a_host_still_warming_up_is_left_alone(tmp_path):
    root = scratch(tmp_path, booted_s_ago=60, serve_within_s=1800, checks=[silent_url()])
    done = guard(root, tmp_path, "watch", "--once")
    assert done.returncode == 0, done.stderr
    assert console(root) == "" and not (root / "shutdown.log").exists()


def test_a_host_that_serves_is_then_held_only_to_max_hours(tmp_path, health_server):
    """Past its serving deadline but answering: no FATAL; max_hours, an absolute time, still ends it."""
    root = scratch(tmp_path, booted_s_ago=3600, serve_within_s=60, checks=[health_server],
                   stop_at=time.time() + 3, max_hours="8")
    started = time.monotonic()
    done = guard(root, tmp_path, "watch")  # the unit's loop, every 0.2 s here
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started >= 1.0  # it waited for STOP_AT
    assert "every instance serves" in done.stdout
    assert console(root) == f"{user_data.STOP_PREFIX} max_hours (8) reached: powering off, which terminates this instance\n"
    assert user_data.FATAL_PREFIX not in console(root)


def test_a_guard_restarted_after_its_host_served_does_not_hold_it_to_the_deadline_again(tmp_path, health_server):
    """Once this boot's instances have all answered, a restart of the guard itself (its unit restarts
    it) past the deadline must not power off a host that serves, whatever one check then says."""
    root = scratch(tmp_path, booted_s_ago=3600, serve_within_s=60, checks=[health_server])
    assert guard(root, tmp_path, "watch", "--once").returncode == 0  # serves: noted for this boot
    silent = silent_url()
    (root / "etc/neuron-disagg/guard.env").write_text(f'SERVE_WITHIN_S=60\nCHECKS="{silent}"\nSTOP_AT=\nMAX_HOURS=8\n')
    guard(root, tmp_path, "watch", "--once")  # restarted; a busy instance misses a check
    assert console(root) == "" and not (root / "shutdown.log").exists()


def test_max_hours_is_on_by_default_and_survives_a_reboot(tmp_path):
    """The user data of the first boot writes max_hours as an absolute time; after a reboot (a new boot
    time, the user data not run again, the guard an enabled unit) the guard still powers off at it,
    before it looks at whether the host serves."""
    config = deployment(tmp_path)
    assert config.max_hours == 8  # on unless the config says 0
    first_boot = int(time.time()) - 9 * 3600
    done, root = run_script(render(config, [("decode", 0)], secret=None), tmp_path, boot_epoch=first_boot)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "enable --now neuron-disagg-guard.service" in (root / "systemctl.log").read_text()
    assert env_file(root / "etc/neuron-disagg/guard.env")["STOP_AT"] == str(first_boot + 8 * 3600)
    (root / "proc/stat").write_text(f"btime {int(time.time()) - 60}\n")  # rebooted a minute ago
    done = guard(root, tmp_path, "watch", "--once")
    assert done.returncode == 0, done.stderr
    assert console(root) == f"{user_data.STOP_PREFIX} max_hours (8) reached: powering off, which terminates this instance\n"
    assert (root / "shutdown.log").read_text().startswith("-h now neuron-disagg: STOP: max_hours (8) reached")
    unit = configparser.ConfigParser(interpolation=None)
    unit.read(UNITS / "neuron-disagg-guard.service")
    assert unit["Install"]["WantedBy"] == "multi-user.target" and unit["Service"]["Restart"] == "always"
    assert unit["Service"]["ExecStart"] == "/opt/neuron-disagg/bin/neuron-disagg-guard watch"


def test_the_guard_without_its_settings_powers_off_rather_than_watch_nothing(tmp_path):
    root = scratch(tmp_path, booted_s_ago=60, serve_within_s=1800, checks=[])
    (root / "etc/neuron-disagg/guard.env").unlink()
    guard(root, tmp_path, "watch", "--once")
    assert console(root).startswith(f"{user_data.FATAL_PREFIX} the guard has no ")
    assert (root / "shutdown.log").exists()


def test_a_unit_systemd_stopped_restarting_powers_the_host_off_with_its_last_words(tmp_path):
    root = scratch(tmp_path, booted_s_ago=60, serve_within_s=1800, checks=[])
    journal = ("INFO starting vllm\n"
               "huggingface_hub.errors.GatedRepoError: 401 Client Error. Cannot access gated repo for url "
               "https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct/resolve/main/config.json.\n\n")
    done = guard(root, tmp_path, "unit-failed", "neuron-disagg-prefill-3", journal=journal)
    assert done.returncode == 0, done.stderr
    assert (root / "journalctl.log").read_text().split()[:2] == ["-u", "neuron-disagg-prefill@3.service"]
    assert console(root).startswith(
        f"{user_data.FATAL_PREFIX} neuron-disagg-prefill@3.service kept failing and systemd stopped restarting it; "
        "its last words: huggingface_hub.errors.GatedRepoError: 401 Client Error. Cannot access gated repo")
    assert (root / "shutdown.log").exists()
    guard(root, tmp_path, "unit-failed", "neuron-disagg-router")
    assert "neuron-disagg-router.service kept failing" in console(root).splitlines()[-1]


def test_status_reads_back_why_a_host_gave_up_or_stopped(tmp_path):
    """What the guard writes is what status shows (ec2:GetConsoleOutput, base64 as EC2 sends it)."""
    import base64

    class Console:
        dry_run = False

        def __init__(self, text):
            self.text = text

        def call(self, service, operation, **params):
            return {"Output": base64.b64encode(self.text.encode()).decode()}

    gave_up = (f"[  OK  ] Started neuron-disagg-guard.service\n{user_data.FATAL_PREFIX} not serving 120 min after "
               "boot: no answer from http://127.0.0.1:8203/health\n")
    assert boot_failure(Console(gave_up), "i-1") == (
        "gave up: not serving 120 min after boot: no answer from http://127.0.0.1:8203/health")
    stopped = f"{user_data.STOP_PREFIX} max_hours (8) reached: powering off, which terminates this instance\n"
    assert boot_failure(Console(stopped), "i-1").startswith("stopped: max_hours (8) reached")


def unit_file(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(UNITS / f"neuron-disagg-{name}.service")
    return parser


@pytest.mark.parametrize("name", ["prefill@", "decode@", "router"])
def test_units_stop_restarting_after_a_few_quick_failures_and_then_power_the_host_off(name):
    """Restarts 10 s apart never reach systemd's default limit (5 starts in 10 s): the units set their
    own, which quick failures do reach, and name what powers the host off once it is reached."""
    unit = unit_file(name)
    interval, burst = int(unit["Unit"]["StartLimitIntervalSec"]), int(unit["Unit"]["StartLimitBurst"])
    restart = int(unit["Service"]["RestartSec"])
    assert burst * (restart + 30) < interval  # four failures within 30 s of their start each reach it
    on_failure = unit["Unit"]["OnFailure"]
    assert on_failure == ("neuron-disagg-fatal@%N.service" if name == "router" else "neuron-disagg-fatal@%p-%i.service")
    fatal = unit_file("fatal@")
    assert fatal["Service"]["ExecStart"] == "/opt/neuron-disagg/bin/neuron-disagg-guard unit-failed %i"
    installed = (REPO / "ami/scripts/50-units.sh").read_text()
    assert 'install -m 0755 "$STAGE/boot/guard.sh" /opt/neuron-disagg/bin/neuron-disagg-guard' in installed
    assert "UNITS=(prefill@ decode@ router model-cache guard fatal@)" in installed


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_accepts_every_unit_and_instance_the_user_data_starts(tmp_path):
    """systemd-analyze verify in a scratch root holding the units, stand-ins for the commands they run
    and this machine's own system units (sysinit.target and the rest they depend on)."""
    root = tmp_path / "root"
    system = root / "etc/systemd/system"
    system.mkdir(parents=True)
    for path in UNITS.glob("*.service"):
        shutil.copy(path, system)
    shutil.copytree(Path("/lib/systemd/system"), root / "usr/lib/systemd/system", symlinks=True)
    for command in ("bin/neuron-disagg-guard", "bin/neuron-disagg-model-cache", "venv/bin/neuron-disagg"):
        path = root / "opt/neuron-disagg" / command
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    names = ["neuron-disagg-guard.service", "neuron-disagg-router.service", "neuron-disagg-model-cache.service",
             "neuron-disagg-prefill@0.service", "neuron-disagg-decode@7.service",
             "neuron-disagg-fatal@neuron-disagg-prefill-0.service", "neuron-disagg-fatal@neuron-disagg-router.service"]
    for name in names:
        done = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", name],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stderr == "" and done.stdout == "", f"{name}: {done.stdout}{done.stderr}"
