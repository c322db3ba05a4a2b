"""ami/boot/model-cache.sh, the boot-time step that puts the model cache (HF_HOME) on local NVMe
instance store: run against a fake /dev tree (NEURON_DISAGG_ROOT) with blkid, mountpoint, mount,
mdadm, mkfs.xfs and udevadm replaced by stand-ins that record what they were asked."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # runs the script as a process

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ami/boot/model-cache.sh"
BY_ID = "dev/disk/by-id"

STAND_INS = {
    # blkid -p DEV: a signature where the test left DEV.sig, else "nothing found" (exit 2)
    "blkid": '[[ -e "${@: -1}.sig" ]] && { cat "${@: -1}.sig"; exit 0; }; exit 2\n',
    "mountpoint": 'grep -qxF -- "${@: -1}" "$STATE/mounted"\n',
    "mount": 'echo "mount $*" >> "$STATE/log"; echo "${@: -1}" >> "$STATE/mounted"\n',
    "mdadm": 'echo "mdadm $*" >> "$STATE/log"\n',
    "mkfs.xfs": 'echo "mkfs.xfs $*" >> "$STATE/log"\n',
    "udevadm": 'exit 0\n',
}


@pytest.fixture
def machine(tmp_path):
    root, state, bin_dir = tmp_path / "root", tmp_path / "state", tmp_path / "bin"
    for d in (root / BY_ID, state, bin_dir):
        d.mkdir(parents=True)
    (state / "mounted").touch()
    (state / "log").touch()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return {"root": root, "state": state, "bin": bin_dir}


def device(machine, name: str, *links: str, signature: str = "") -> Path:
    """A fake device /dev/<name> and its /dev/disk/by-id links (relative, as udev makes them)."""
    dev = machine["root"] / "dev" / name
    dev.touch()
    if signature:
        Path(f"{dev}.sig").write_text(signature)
    for link in links:
        (machine["root"] / BY_ID / link).symlink_to(f"../../{name}")
    return dev


def instance_store(machine, count: int, signature: str = "") -> list[Path]:
    return [device(machine, f"nvme{i}n1", f"nvme-Amazon_EC2_NVMe_Instance_Storage_AWS{i}ABCDEF",
                   f"nvme-Amazon_EC2_NVMe_Instance_Storage_AWS{i}ABCDEF_1", signature=signature)
            for i in range(1, count + 1)]


def run(machine, **env) -> tuple[subprocess.CompletedProcess, list[str], str | None]:
    full = {**os.environ, "PATH": f"{machine['bin']}:{os.environ['PATH']}", "STATE": str(machine["state"]),
            "NEURON_DISAGG_ROOT": str(machine["root"]), "DLAMI_WAIT_S": "0", **env}
    done = subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=60)
    log = (machine["state"] / "log").read_text().splitlines()
    env_file = machine["root"] / "run/neuron-disagg/model-cache.env"
    return done, log, env_file.read_text() if env_file.exists() else None


def hf_home(env_text: str) -> str:
    return next(line.split("=", 1)[1] for line in env_text.splitlines() if line.startswith("HF_HOME="))


def test_no_instance_store_is_a_no_op(machine):
    # only the root EBS volume, as on an m6i builder or an instance type without instance store
    device(machine, "nvme0n1", "nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0")
    done, log, env = run(machine)
    assert done.returncode == 0, done.stderr
    assert log == [] and env is None
    assert "no NVMe instance store" in done.stdout


def test_no_by_id_directory_at_all_is_a_no_op(machine):
    (machine["root"] / BY_ID).rmdir()
    done, log, env = run(machine)
    assert done.returncode == 0 and log == [] and env is None, done.stderr


def test_one_blank_device_is_formatted_and_mounted_without_raid(machine):
    device(machine, "nvme0n1", "nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0")
    [dev] = instance_store(machine, 1)
    done, log, env = run(machine)
    assert done.returncode == 0, done.stderr
    mount_point = machine["root"] / "opt/neuron-disagg/nvme"
    assert log == [f"mkfs.xfs -q -f -K -L nd-models {dev}", f"mount -o noatime {dev} {mount_point}"]
    assert hf_home(env) == "/opt/neuron-disagg/nvme/neuron-disagg/hf"
    assert (mount_point / "neuron-disagg/hf").is_dir()


def test_several_blank_devices_are_striped_once_each_in_order(machine):
    """trn2.48xlarge has 4, p5en.48xlarge 8: each by-id name has a namespace twin (_1) and may have
    partitions; each device goes into the array once, the root EBS volume never."""
    device(machine, "nvme0n1", "nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0")
    devs = instance_store(machine, 8)
    device(machine, "nvme3n1p1", "nvme-Amazon_EC2_NVMe_Instance_Storage_AWS3ABCDEF-part1")
    done, log, env = run(machine)
    assert done.returncode == 0, done.stderr
    md = machine["root"] / "dev/md/neuron-disagg-models"
    assert log[0] == ("mdadm --create " + f"{md} --run --level=0 --raid-devices=8 --name=neuron-disagg-models "
                      + " ".join(map(str, devs)))
    assert log[1:] == [f"mkfs.xfs -q -f -K -L nd-models {md}",
                       f"mount -o noatime {md} {machine['root'] / 'opt/neuron-disagg/nvme'}"]
    assert hf_home(env) == "/opt/neuron-disagg/nvme/neuron-disagg/hf"


def test_the_dlamis_own_mount_is_used_and_nothing_is_formatted(machine):
    instance_store(machine, 8, signature="TYPE=linux_raid_member")
    dlami = machine["root"] / "opt/dlami/nvme"
    dlami.mkdir(parents=True)
    (machine["state"] / "mounted").write_text(f"{dlami}\n")
    done, log, env = run(machine)
    assert done.returncode == 0, done.stderr
    assert log == []
    assert hf_home(env) == "/opt/dlami/nvme/neuron-disagg/hf" and (dlami / "neuron-disagg/hf").is_dir()


def test_the_dlami_mount_point_is_waited_for_then_blank_devices_are_ours(machine):
    devs = instance_store(machine, 2)
    (machine["root"] / "opt/dlami/nvme").mkdir(parents=True)  # the DLAMI's directory, never mounted here
    done, log, env = run(machine, DLAMI_WAIT_S="1")
    assert done.returncode == 0, done.stderr
    assert log[0].startswith("mdadm --create") and log[0].endswith(f"{devs[0]} {devs[1]}")
    assert hf_home(env) == "/opt/neuron-disagg/nvme/neuron-disagg/hf"


def test_devices_holding_someone_elses_data_are_left_alone(machine):
    instance_store(machine, 4, signature="TYPE=ext4")
    done, log, env = run(machine)
    assert done.returncode == 0, done.stderr
    assert not [line for line in log if line.startswith(("mkfs", "mount", "mdadm --create"))]
    assert env is None and "leaving them alone" in done.stdout


def test_after_a_reboot_our_filesystem_is_mounted_again_not_reformatted(machine):
    instance_store(machine, 4, signature="TYPE=linux_raid_member")
    md = device(machine, "md127", signature="TYPE=xfs LABEL=nd-models")
    label = machine["root"] / "dev/disk/by-label"
    label.mkdir(parents=True)
    (label / "nd-models").symlink_to(md)
    done, log, env = run(machine)
    assert done.returncode == 0, done.stderr
    assert not [line for line in log if line.startswith(("mkfs", "mdadm --create"))]
    assert f"mount -o noatime {label / 'nd-models'} {machine['root'] / 'opt/neuron-disagg/nvme'}" in log
    assert hf_home(env) == "/opt/neuron-disagg/nvme/neuron-disagg/hf"


def test_run_again_while_mounted_changes_nothing(machine):
    instance_store(machine, 1)
    mount_point = machine["root"] / "opt/neuron-disagg/nvme"
    mount_point.mkdir(parents=True)
    (machine["state"] / "mounted").write_text(f"{mount_point}\n")
    done, log, env = run(machine)
    assert done.returncode == 0 and log == [], done.stderr
    assert hf_home(env) == "/opt/neuron-disagg/nvme/neuron-disagg/hf"


def test_the_units_read_the_cache_env_after_fabric_env():
    """prefill and decode want the model-cache unit, start after it, and read its file (optional:
    '-') after fabric.env, whose HF_HOME it overrides."""
    for role in ("prefill", "decode"):
        text = (REPO / f"ami/units/neuron-disagg-{role}@.service").read_text()
        assert "neuron-disagg-model-cache.service" in next(line for line in text.splitlines() if line.startswith("Wants="))
        assert "neuron-disagg-model-cache.service" in next(line for line in text.splitlines() if line.startswith("After="))
        files = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("EnvironmentFile=")]
        assert files.index("-/run/neuron-disagg/model-cache.env") == files.index("/etc/neuron-disagg/fabric.env") + 1
    unit = (REPO / "ami/units/neuron-disagg-model-cache.service").read_text()
    assert "ExecStart=/opt/neuron-disagg/bin/neuron-disagg-model-cache" in unit and "Type=oneshot" in unit
    units_script = (REPO / "ami/scripts/50-units.sh").read_text()
    assert '"$STAGE/boot/model-cache.sh" /opt/neuron-disagg/bin/neuron-disagg-model-cache' in units_script
