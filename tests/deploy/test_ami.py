"""ami/: the Packer template parses, agrees with what launch looks for and builds on ordinary
instances; it pins and records what it builds from; its doctor step needs no accelerator; the
provisioning scripts pass shellcheck; what NIXL's LIBFABRIC plugin lacks is put in place on both
images (on Trainium a libcuda stub that answers CUDA_ERROR_NO_DEVICE among it; on the GPU image the
CUDA runtime and hwloc, never a stub); the EFA installer step installs the pinned version and
refuses anything not signed by the pinned key (exercised with a throwaway key over local HTTP).
The model-cache boot script: test_ami_model_cache.py."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import hcl2
import pytest

from neuron_disagg.deploy import ami
from neuron_disagg.deploy.instance_types import InstanceTypeInfo
from neuron_disagg.doctor import run_checks
from neuron_disagg.local_cluster import free_port
from neuron_disagg.platforms import fabric_libs

from .conftest import wait_until_serving
from .test_user_data import shellcheck

pytestmark = pytest.mark.integration  # runs the provisioning scripts, shellcheck and doctor as processes

REPO = Path(__file__).resolve().parents[2]
AMI = REPO / "ami"
SCRIPTS = sorted((AMI / "scripts").glob("*.sh"))
HIDE_CUDA = 'for d in /usr/local/cuda*; do [ -L "$d" ] || mount -t tmpfs none "$d"; done; exec "$@"'


def unquote(value):
    """python-hcl2 >= 7 keeps string literals' quotes."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


@pytest.fixture(scope="module")
def template() -> dict:
    with (AMI / "neuron-disagg.pkr.hcl").open() as f:
        return hcl2.load(f)


def blocks(items: list[dict], kind: str) -> dict[str, dict]:
    """{'"amazon-ebs"': {'"neuron"': {...}}} rows -> {'neuron': {...}} for one block type."""
    found = {}
    for item in items:
        for block_type, named in item.items():
            if unquote(block_type) == kind:
                for name, body in named.items():
                    found[unquote(name)] = body
    return found


def test_template_has_a_trainium_source_pinned_by_sdk_and_a_gpu_source_from_its_ssm_parameter(template):
    sources = blocks(template["source"], "amazon-ebs")
    assert set(sources) == {"neuron", "cuda"}
    data = blocks(template["data"], "amazon-parameterstore")
    variables = {unquote(k): v for item in template["variable"] for k, v in item.items()}
    local = {unquote(k): v for item in template["locals"] for k, v in item.items()}
    # The GPU DLAMI: its SSM parameter's latest unless an AMI id is pinned; the tag records which.
    cuda = sources["cuda"]
    assert unquote(cuda["source_ami"]) == "${local.cuda_source_ami}"
    assert local["cuda_source_ami"] == "${coalesce(var.cuda_source_ami, data.amazon-parameterstore.cuda_dlami.value)}"
    assert unquote(data["cuda_dlami"]["name"]) == "${var.cuda_ssm_parameter}"
    assert unquote(variables["cuda_ssm_parameter"]["default"]) == ami.DLAMI_PARAMETERS["cuda"]
    assert '"neuron-disagg:source-ami" = local.cuda_source_ami' in cuda["tags"]
    # The Neuron DLAMI: the pinned SDK release's (test_bake.py), an AMI id only if it is one of them.
    neuron = sources["neuron"]
    assert unquote(neuron["source_ami"]) == "${var.neuron_source_ami}" and "neuron_dlami" not in data
    assert '"neuron-disagg:source-ami" = "{{ .SourceAMI }}"' in neuron["tags"]
    for platform, source in sources.items():
        assert variables[f"{platform}_source_ami"]["default"] is None
        # the tag launch finds the baked AMI by
        assert f'"{ami.PLATFORM_TAG}" = "{platform}"' in source["tags"]


def test_template_provisions_every_script_in_order_and_ends_with_doctor(template):
    build = template["build"][0]
    shell_steps = [body for p in build["provisioner"] for kind, body in p.items() if unquote(kind) == "shell"]
    listed = []
    for step in shell_steps:
        for entry in step.get("scripts", []) + ([step["script"]] if "script" in step else []):
            listed.append(unquote(entry).replace("${path.root}/", ""))
    assert listed == [f"scripts/{p.name}" for p in SCRIPTS]
    assert listed[-1] == "scripts/90-doctor.sh"
    variables = {unquote(k): v for item in template["variable"] for k, v in item.items()}
    assert unquote(variables["doctor_command"]["default"]) == ""  # 90-doctor.sh: --image --platform <source>
    doctor = (AMI / "scripts/90-doctor.sh").read_text()
    assert "neuron-disagg doctor --image --platform ${PLATFORM" in doctor
    assert unquote(variables["nixl_version"]["default"]) == "1.5.0"


def steps_for(template, source: str) -> list[str]:
    """The provisioning scripts Packer runs for ``source`` (its only/except filters applied)."""
    build = template["build"][0]
    scripts = []
    for item in build["provisioner"]:
        for kind, step in item.items():
            only = [unquote(o) for o in step.get("only", [])]
            excluded = [unquote(o) for o in step.get("except", [])]
            if unquote(kind) != "shell" or (only and source not in only) or source in excluded:
                continue
            for entry in step.get("scripts", []) + ([step["script"]] if "script" in step else []):
                scripts.append(unquote(entry).replace("${path.root}/", ""))
    return scripts


@pytest.mark.parametrize("source", ["amazon-ebs.neuron", "amazon-ebs.cuda"])
def test_both_images_get_the_fabric_libraries_before_doctor(template, source):
    """The GPU image too: its NVIDIA driver provides libcuda but neither libcudart nor hwloc, and
    the bake's last step loads NIXL's LIBFABRIC backend."""
    steps = steps_for(template, source)
    assert steps.index("scripts/40-fabric-libs.sh") < steps.index("scripts/90-doctor.sh")
    assert steps.index("scripts/30-python.sh") < steps.index("scripts/40-fabric-libs.sh")
    libs_step = next(body for item in template["build"][0]["provisioner"] for kind, body in item.items()
                     if unquote(body.get("script", "")).endswith("40-fabric-libs.sh"))
    assert "PLATFORM=${source.name}" in [unquote(v) for v in libs_step["environment_vars"]]
    script = (AMI / "scripts/40-fabric-libs.sh").read_text()
    assert 'install-fabric-libs --platform "$PLATFORM"' in script


def test_versions_are_pinned_and_recorded_in_tags(template):
    variables = {unquote(k): v for item in template["variable"] for k, v in item.items()}
    efa = unquote(variables["efa_installer_version"]["default"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", efa)  # a release, never "latest"
    # 10-efa.sh's own default is the same pin, and the template hands it the variable
    assert f'EFA_VERSION="${{EFA_VERSION:-{efa}}}"' in (AMI / "scripts/10-efa.sh").read_text()
    first = next(body for item in template["build"][0]["provisioner"] for kind, body in item.items()
                 if "scripts" in body and any("10-efa.sh" in unquote(e) for e in body["scripts"]))
    assert "EFA_VERSION=${var.efa_installer_version}" in [unquote(v) for v in first["environment_vars"]]
    local = {unquote(k): v for item in template["locals"] for k, v in item.items()}
    tags = {unquote(k): unquote(v) for k, v in local["tags"].items() if not k.startswith("__")}
    assert tags["neuron-disagg:nixl"] == "${var.nixl_version}"
    assert tags["neuron-disagg:efa-installer-min"] == "${var.efa_installer_version}"
    assert tags["neuron-disagg:source-ami-name"] == "{{ .SourceAMIName }}"  # the DLAMI's dated name
    for source in blocks(template["source"], "amazon-ebs").values():
        assert "${merge(local.tags" in source["tags"]


def test_builders_are_ordinary_x86_instances_without_accelerators(template, ec2):
    """The bake must not wait for (or pay for) trn2/p5en capacity: each source builds on its variable,
    whose default moto's copy of AWS's instance data shows to have no Neuron device and no GPU, and
    to run x86_64 like both DLAMIs; no capacity reservation by default."""
    sources = blocks(template["source"], "amazon-ebs")
    variables = {unquote(k): v for item in template["variable"] for k, v in item.items()}
    for platform, source in sources.items():
        assert unquote(source["instance_type"]) == f"${{var.{platform}_instance_type}}"
        builder = unquote(variables[f"{platform}_instance_type"]["default"])
        item = ec2.describe_instance_types(InstanceTypes=[builder])["InstanceTypes"][0]
        assert InstanceTypeInfo.from_api(item).platform is None, builder
        assert "x86_64" in item["ProcessorInfo"]["SupportedArchitectures"]
        assert not builder.startswith(("trn", "inf", "p4", "p5", "p6", "g"))
    assert variables["capacity_reservation_id"]["default"] is None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None,
                    reason="doctor checks vLLM and NIXL, which the bake installs (scripts/setup.sh here)")
@pytest.mark.parametrize("with_fabric_libs", [False, True])
def test_doctor_image_for_neuron_on_a_host_without_accelerators(tmp_path, monkeypatch, with_fabric_libs):
    """What 90-doctor.sh runs on the builder, `doctor --image --platform neuron`, with the units'
    fabric environment, a filesystem root holding no Neuron or NVIDIA device, and the EFA installer's
    fi_info: it fails while NIXL's LIBFABRIC backend cannot load, and passes once the fabric
    libraries (40-fabric-libs.sh) are on the library path."""
    from neuron_disagg.platforms import fabric_libs

    from ..integration.fabrics import libfabric_alone, libfabric_libs

    library_dir = libfabric_libs() if with_fabric_libs else libfabric_alone(tmp_path / "efa")
    fabric = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
              "FI_EFA_ENABLE_SHM_TRANSFER": "0"}  # as ami/scripts/50-units.sh writes fabric.env
    for key, value in fabric.items():
        monkeypatch.setenv(key, value)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fi_info").write_text('#!/bin/sh\n[ "$1" = --version ] && echo "libfabric: 1.22.0amzn1.0" '
                                     '|| printf "efa:\\n    version: 122.0\\ntcp:\\n"\n')
    (bin_dir / "fi_info").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(fabric_libs, "SYSTEM_DIR", tmp_path / "no-such-dir")
    monkeypatch.setenv("NEURON_DISAGG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(library_dir))
    root = tmp_path / "root"
    root.mkdir()
    checks, summary = run_checks(root=str(root), image=True, image_platform="neuron")
    failed = [c.name for c in checks if c.status == "fail"]
    assert summary["platform"] == "neuron" and summary["nixl_backend"] == "LIBFABRIC"
    assert failed == ([] if with_fabric_libs else ["nixl backend LIBFABRIC", "fabric libraries"]), failed
    by_name = {c.name: c for c in checks}
    assert by_name["secret"].status == "warn" and "image being baked" in by_name["secret"].message
    assert "neuron devices" not in by_name  # the builder has none; the launched instance is checked


@pytest.mark.parametrize("script", [*SCRIPTS, AMI / "build.sh", *sorted((AMI / "boot").glob("*.sh")),
                                    *sorted((AMI.parent / "scripts").glob("*.sh"))], ids=lambda p: p.name)
def test_provisioning_scripts_pass_shellcheck(script):
    done = subprocess.run([shellcheck(), "-x", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_packer_validate(tmp_path):
    packer = shutil.which("packer")
    if packer is None:
        pytest.skip("packer is not installed here (HashiCorp's binary; Debian's 1.6 predates data sources)")
    version = subprocess.run([packer, "version"], capture_output=True, text=True).stdout
    numbers = tuple(int(n) for n in re.findall(r"(\d+)\.(\d+)", version)[0])
    if numbers < (1, 7):
        pytest.skip(f"packer {version.strip()} predates data sources and required_plugins (needs >= 1.7)")
    # Full validation needs the amazon plugin (`packer init`, a download) and AWS access for the SSM
    # data sources; ami/build.sh runs it. Here: syntax and references.
    done = subprocess.run([packer, "validate", "-syntax-only", "-var", f"wheel={tmp_path}/x.whl", str(AMI)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_fabric_libs_step_puts_what_nixls_libfabric_plugin_lacks_beside_the_efa_libfabric(tmp_path):
    """40-fabric-libs.sh with libfabric alone on the path (as the EFA installer leaves it): the
    package's own step provides the rest, down to a libcuda stub that answers CUDA_ERROR_NO_DEVICE,
    and proves the backend loads."""
    from ..integration.fabrics import libfabric_alone

    efa = libfabric_alone(tmp_path / "efa")
    target = tmp_path / "lib"
    # The bake's venv is /opt/neuron-disagg/venv; here it is the one scripts/setup.sh made.
    env = {**os.environ, "PLATFORM": "neuron", "LIB_DIR": str(target), "UNITS_LIBRARY_PATH": str(efa),
           "NEURON_DISAGG": str(Path(sys.executable).with_name("neuron-disagg"))}
    done = subprocess.run(["bash", str(AMI / "scripts/40-fabric-libs.sh")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NIXL's LIBFABRIC backend loads" in done.stdout
    assert (target / "libhwloc.so.15").exists() and (target / ".neuron-disagg-fabric-libs").exists()
    library = target / "libcuda.so.1"
    soname = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True).stdout
    assert "[libcuda.so.1]" in soname
    lib = ctypes.CDLL(str(library))
    buffer = ctypes.create_string_buffer(b"x" * 16)
    assert lib.cuCtxSetCurrent(None) == 100
    assert lib.cuDeviceGetPCIBusId(buffer, 16, 0) == 100 and buffer.value == b""
    assert lib.cuPointerGetAttributes(1, None, None, ctypes.c_ulonglong(0)) == 100


def test_fabric_libs_step_refuses_an_unknown_platform(tmp_path):
    env = {**os.environ, "PLATFORM": "rocm", "LIB_DIR": str(tmp_path)}
    done = subprocess.run(["bash", str(AMI / "scripts/40-fabric-libs.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "PLATFORM must be neuron or cuda" in done.stderr
    assert not list(tmp_path.iterdir())


GPU_IMAGE = r"""
import json, os, pathlib, subprocess, sys
from cuda_compat import CudaPlatform
from neuron_disagg import doctor
from neuron_disagg.platforms import fabric_libs, libcuda_stub
script, efa, driver, target, root = sys.argv[1:6]
target = pathlib.Path(target)
fabric_libs.SYSTEM_DIR = target  # where the AMI's units look (/opt/neuron-disagg/lib)
libcuda_stub.build(pathlib.Path(driver))  # stands in for the NVIDIA driver's libcuda.so.1
libcuda_stub.build(target)  # a stub an earlier Neuron-style run left: must go
env_file = pathlib.Path(root) / doctor.UNITS_ENV
env_file.parent.mkdir(parents=True)
env_file.write_text(f"FI_PROVIDER=efa\nLD_LIBRARY_PATH={target}:{efa}:{driver}\n")  # as 50-units.sh writes it
os.environ["LD_LIBRARY_PATH"] = f"{efa}:{driver}"  # 90-doctor.sh's shell: fabric.env without our directory
out = {"before": doctor.check_fabric_libs(CudaPlatform(root), "LIBFABRIC").__dict__}
done = subprocess.run(["bash", script], capture_output=True, text=True, env={
    **os.environ, "PLATFORM": "cuda", "LIB_DIR": str(target), "UNITS_LIBRARY_PATH": f"{efa}:{driver}",
    "NEURON_DISAGG": str(pathlib.Path(sys.executable).with_name("neuron-disagg"))})
out["script"] = [done.returncode, done.stdout, done.stderr]
out["after"] = doctor.check_fabric_libs(CudaPlatform(root), "LIBFABRIC").__dict__
out["files"] = sorted(p.name for p in target.iterdir())
print(json.dumps(out))
"""


def test_fabric_libs_step_for_a_gpu_image_provides_the_runtime_and_hwloc_and_no_stub(tmp_path):
    """The GPU image's 40-fabric-libs.sh, with this machine's CUDA toolkit hidden (as on the GPU
    DLAMI, whose runtime is not where the linker looks) and a libcuda.so.1 standing in for the
    driver's: doctor's CUDA check first names what the plugin lacks with the units' library path,
    the step provides libcudart and hwloc (and removes a stub left there), then the check passes."""
    from ..integration.fabrics import libfabric_alone

    efa = libfabric_alone(tmp_path / "efa")
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", HIDE_CUDA, "sh", sys.executable, "-c",
         GPU_IMAGE, str(AMI / "scripts/40-fabric-libs.sh"), str(efa), str(tmp_path / "driver"),
         str(tmp_path / "lib"), str(tmp_path / "root")],
        capture_output=True, text=True, timeout=900,
        env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = out["before"], out["after"]
    assert before["status"] == "fail", before
    assert "libcudart.so.13" in before["message"] and "libhwloc.so.15" in before["message"], before
    assert "units' LD_LIBRARY_PATH" in before["message"] and "--platform cuda" in before["fix"], before
    assert out["script"][0] == 0, out["script"]
    assert "NIXL's LIBFABRIC backend loads" in out["script"][1]
    assert "libcuda.so.1" not in out["files"] and not [f for f in out["files"] if f.startswith(".built-from")]
    assert {"libcudart.so.13", "libhwloc.so.15", fabric_libs.STAMP} <= set(out["files"]), out["files"]
    assert after["status"] == "ok", after


# -- the EFA installer's signature check, with a throwaway key ------------------------------------
_PIN = re.search(r'EFA_VERSION="\$\{EFA_VERSION:-([0-9.]+)\}"', (AMI / "scripts/10-efa.sh").read_text())
PINNED_EFA = _PIN.group(1) if _PIN else "0.0.0-not-pinned"  # 10-efa.sh's default installer version
FAKE_INSTALLER = """#!/bin/bash
# stands in for AWS's efa_installer.sh: "installs" libfabric under $EFA_PREFIX
set -euo pipefail
mkdir -p "$EFA_PREFIX/lib" "$EFA_PREFIX/bin"
touch "$EFA_PREFIX/lib/libfabric.so.1" "$EFA_PREFIX/installer-ran-with-$1"
printf '#!/bin/sh\\necho "fi_info: 1.22.0amzn4.0"\\necho "libfabric: 1.22.0amzn4.0"\\n' > "$EFA_PREFIX/bin/fi_info"
chmod +x "$EFA_PREFIX/bin/fi_info"
"""


@pytest.fixture
def efa_site(tmp_path):
    """A local HTTP 'efa-installer.amazonaws.com': tarball, detached signature, public key."""
    if shutil.which("gpg") is None:
        pytest.skip("gpg is not installed here")
    home = tmp_path / "gnupg"
    home.mkdir(mode=0o700)
    gpg = ["gpg", "--batch", "--homedir", str(home), "--passphrase", "", "--pinentry-mode", "loopback"]
    subprocess.run([*gpg, "--quick-gen-key", "Test EFA signer <efa@example.invalid>", "ed25519", "sign", "never"],
                   check=True, capture_output=True)
    listing = subprocess.run([*gpg, "--with-colons", "--list-keys"], check=True, capture_output=True, text=True).stdout
    fingerprint = next(line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr"))
    site = tmp_path / "site"
    (site / "aws-efa-installer").mkdir(parents=True)
    installer = site / "aws-efa-installer" / "efa_installer.sh"
    installer.write_text(FAKE_INSTALLER)
    installer.chmod(0o755)
    tarball = site / f"aws-efa-installer-{PINNED_EFA}.tar.gz"  # only the pinned version is published here
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(site / "aws-efa-installer", arcname="aws-efa-installer")
    subprocess.run([*gpg, "--detach-sign", "-o", f"{tarball}.sig", str(tarball)], check=True, capture_output=True)
    subprocess.run([*gpg, "--armor", "--export", "-o", str(site / "aws-efa-installer.key"), fingerprint],
                   check=True, capture_output=True)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory",
                               str(site)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until_serving(f"http://127.0.0.1:{port}/aws-efa-installer.key", server, 20, "local HTTP server")
    yield {"url": f"http://127.0.0.1:{port}", "fingerprint": fingerprint, "site": site, "prefix": tmp_path / "efa"}
    server.terminate()
    server.wait(10)
    subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "all"], capture_output=True)


def run_efa(site: dict, fingerprint: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "EFA_URL": site["url"], "EFA_KEY_FINGERPRINT": fingerprint, "EFA_PREFIX": str(site["prefix"]),
           "EFA_INSTALLED": str(site["prefix"].parent / "no-efa-installed"),
           "VERSIONS_FILE": str(site["prefix"].parent / "image-versions")}
    return subprocess.run(["bash", str(AMI / "scripts/10-efa.sh")], env=env, capture_output=True, text=True,
                          timeout=120)


def test_efa_installer_runs_only_after_the_signature_checks_out(efa_site):
    done = run_efa(efa_site, efa_site["fingerprint"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "signature verified" in done.stdout and "libfabric 1.22.0amzn4.0 installed" in done.stdout
    assert f"aws-efa-installer-{PINNED_EFA}.tar.gz signature verified" in done.stdout  # the pinned one, not latest
    assert (efa_site["prefix"] / "installer-ran-with---yes").exists()
    versions = (efa_site["prefix"].parent / "image-versions").read_text()
    assert versions == f"EFA_INSTALLER_VERSION={PINNED_EFA}\nLIBFABRIC_VERSION=1.22.0amzn4.0\n"


def test_efa_installer_refuses_a_key_that_is_not_the_pinned_one(efa_site):
    done = run_efa(efa_site, "4E9091BCBB97A96B26B15E59A05480B1DD2D3CCC")  # AWS's key; ours is a throwaway
    assert done.returncode == 1 and "not AWS's published" in done.stderr
    assert not efa_site["prefix"].exists()


def test_efa_installer_refuses_a_tampered_tarball(efa_site):
    tarball = efa_site["site"] / f"aws-efa-installer-{PINNED_EFA}.tar.gz"
    tarball.write_bytes(tarball.read_bytes() + b"\0")
    done = run_efa(efa_site, efa_site["fingerprint"])
    assert done.returncode == 1 and "does not verify" in done.stderr
    assert not efa_site["prefix"].exists()


def test_builders_let_ssh_in_from_the_building_machine_only(template):
    for name, source in blocks(template["source"], "amazon-ebs").items():
        assert source.get("temporary_security_group_source_public_ip") is True, name


def _installed_efa(tmp_path, libfabric: str, installer: str = PINNED_EFA) -> dict:
    prefix = tmp_path / "efa"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "fi_info").write_text(f'#!/bin/sh\necho "libfabric: {libfabric}"\n')
    (prefix / "bin" / "fi_info").chmod(0o755)
    record = tmp_path / "efa_installed_packages"
    record.write_text(f"# EFA installer version: {installer}\n# Debug packages installed: no\n")
    modules = tmp_path / "modules-load.d"
    modules.mkdir()
    (modules / "efa.conf").write_text("efa\nefa_nv_peermem\n")
    return {**os.environ, "EFA_PREFIX": str(prefix), "EFA_INSTALLED": str(record), "MODULES_LOAD_DIR": str(modules),
            "EFA_URL": "http://127.0.0.1:9/nothing-here", "VERSIONS_FILE": str(tmp_path / "image-versions")}


def _newer(version: str) -> str:
    major, minor, patch = map(int, version.split("."))
    return f"{major}.{minor + 1}.0"


@pytest.mark.parametrize("platform", ["neuron", "cuda"])
@pytest.mark.parametrize("installer", ["pinned", "newer"])
def test_an_image_whose_efa_is_current_is_not_reinstalled(tmp_path, platform, installer):
    version = PINNED_EFA if installer == "pinned" else _newer(PINNED_EFA)
    env = {**_installed_efa(tmp_path, "1.22.0amzn4.0", version), "PLATFORM": platform}
    done = subprocess.run(["bash", str(AMI / "scripts/10-efa.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"the image's EFA is current (installer {version} >= pinned {PINNED_EFA}, libfabric 1.22.0amzn4.0" in done.stdout
    modules = (tmp_path / "modules-load.d" / "efa.conf").read_text()
    assert modules == ("efa\n" if platform == "neuron" else "efa\nefa_nv_peermem\n")
    # what the image really carries, beside the tag's minimum
    assert (tmp_path / "image-versions").read_text() == f"EFA_INSTALLER_VERSION={version}\nLIBFABRIC_VERSION=1.22.0amzn4.0\n"


def test_an_image_whose_efa_installer_is_older_than_the_pin_gets_the_pinned_one(tmp_path):
    env = {**_installed_efa(tmp_path, "1.22.0amzn4.0", "1.38.0"), "PLATFORM": "cuda"}
    done = subprocess.run(["bash", str(AMI / "scripts/10-efa.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "not reinstalling" not in done.stdout  # went for the installer (unreachable here)
    assert f"the image has EFA installer 1.38.0 (libfabric 1.22.0amzn4.0): installing the pinned {PINNED_EFA}" in done.stdout


def test_the_efa_version_must_be_a_pinned_release(tmp_path):
    env = {**_installed_efa(tmp_path, "1.22.0amzn4.0"), "EFA_VERSION": "latest"}
    done = subprocess.run(["bash", str(AMI / "scripts/10-efa.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "must be a version like" in done.stderr


def test_an_image_whose_efa_is_too_old_is_reinstalled(tmp_path):
    env = {**_installed_efa(tmp_path, "1.18.1amzn1.0"), "PLATFORM": "neuron"}
    done = subprocess.run(["bash", str(AMI / "scripts/10-efa.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "not reinstalling" not in done.stdout  # went for the installer (unreachable here)
