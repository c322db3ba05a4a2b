"""The bake (ami/): it works without a default VPC (Session Manager, or a public IP said plainly),
its AMIs are found in other regions, its Trainium DLAMI is pinned by Neuron SDK release and
checked before anything bills, and its apt steps wait for a fresh DLAMI's own apt jobs.

The template is read with python-hcl2; ami/build.sh's check (neuron_disagg/deploy/bake.py) runs
against moto as a server. moto holds no Amazon-owned DLAMIs: ``PublicImages`` answers
DescribeImages for owner "amazon" (and for those images' ids) with images shaped as AWS describes
its DLAMIs (name, description naming the SDK), the way conftest's ``PublicParameters`` answers the
public SSM parameters; every other call goes to moto."""

from __future__ import annotations

import fnmatch
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest

from neuron_disagg.deploy import ami, bake
from neuron_disagg.deploy.cloud import Cloud
from neuron_disagg.platforms import fabric_libs

from .conftest import REGION, _answer, register_image
from .test_ami import template, unquote  # noqa: F401  (template: a fixture)

REPO = Path(__file__).resolve().parents[2]
AMI = REPO / "ami"
LATEST = bake.LATEST_NEURON_PARAMETER




def sources(template) -> dict[str, dict]:
    return {unquote(name): body for item in template["source"] for _, named in item.items()
            for name, body in named.items()}


def variables(template) -> dict[str, Any]:
    return {unquote(k): v for item in template["variable"] for k, v in item.items()}


# -- the template ------------------------------------------------------------------------------------------

def test_builders_connect_through_session_manager_unless_told_to_use_a_public_ip(template):
    """No public address is assumed: by default Packer tunnels SSH through Systems Manager (a private
    subnet with a NAT gateway works), and public_ip asks for a public address outright."""
    var = variables(template)["builder_connect"]
    assert unquote(var["default"]) == "session_manager"
    assert 'contains(["session_manager", "public_ip"], var.builder_connect)' in var["validation"][0]["condition"]
    for name, source in sources(template).items():
        assert unquote(source["ssh_interface"]) == "${var.builder_connect}", name
        assert unquote(source["associate_public_ip_address"]) == '${var.builder_connect == "public_ip" ? true : null}'
        (dynamic,) = source["dynamic"]
        profile = dynamic['"temporary_iam_instance_profile_policy_document"']
        assert profile["for_each"] == '${var.builder_connect == "session_manager" ? [1] : []}'
        (statement,) = profile["content"][0]["Statement"]
        assert unquote(statement["Action"]) == "${local.ssm_session_actions}"
    local = {unquote(k): v for item in template["locals"] for k, v in item.items()}
    assert [unquote(a) for a in local["ssm_session_actions"]] == [
        "ssm:UpdateInstanceInformation", "ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
        "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel"]


def test_the_trainium_dlami_is_found_by_its_neuron_sdk_release(template):
    """Not by .../ubuntu-24.04/latest, which stops moving when a release moves to another OS."""
    neuron = sources(template)["neuron"]
    (found,) = neuron["source_ami_filter"]
    assert {k: unquote(v) for k, v in found["filters"].items()} == {
        "name": "${var.neuron_dlami_name}", "description": "*Neuron SDK ${var.neuron_sdk_version}*", "state": "available"}
    assert [unquote(o) for o in found["owners"]] == ["amazon"] and found["most_recent"] is True
    assert '"neuron-disagg:neuron-sdk" = var.neuron_sdk_version' in neuron["tags"]
    var = variables(template)
    for name in ("neuron_sdk_version", "neuron_dlami_name", "builder_connect", "region"):
        assert unquote(var[name]["default"]) == bake.DEFAULTS[name], name  # what ami/build.sh's check assumes
    assert "neuron_ssm_parameter" not in var


def test_copies_the_bake_makes_carry_the_tags_launch_finds_them_by(template):
    assert variables(template)["ami_regions"]["default"] == []
    for name, source in sources(template).items():
        assert unquote(source["ami_regions"]) == "${var.ami_regions}", name
        assert unquote(source["ami_name"]).startswith(ami.baked_name_prefix(name))


def test_build_sh_checks_before_it_builds_anything():
    script = (AMI / "build.sh").read_text()
    assert script.index('-m neuron_disagg.deploy.bake "$@"') < script.index("pip wheel") < script.index("packer build")


# -- ami/build.sh's check, against moto --------------------------------------------------------------------

class PublicImages:
    """Amazon's DLAMIs, which moto does not hold: DescribeImages with Owners=["amazon"] (its name,
    description and state filters applied as EC2 applies them, * as a wildcard), or naming their ids."""

    def __init__(self) -> None:
        self.images: list[dict[str, Any]] = []
        self._params: dict[str, Any] = {}

    def add(self, image_id: str, name: str, sdk: str, created: str) -> str:
        self.images.append({"ImageId": image_id, "Name": name, "State": "available", "CreationDate": created,
                            "OwnerId": "898082745236", "ImageOwnerAlias": "amazon",
                            "Description": f"Supported EC2 instances: Inf2, Trn1, Trn2. Neuron SDK {sdk}, vLLM"})
        return image_id

    def install(self, session: boto3.Session) -> None:
        session.events.register("before-parameter-build.ec2.DescribeImages", self._keep)
        session.events.register("before-call.ec2.DescribeImages", self._answer)

    def _keep(self, params, **_):
        self._params = dict(params)

    def _answer(self, **_):
        params = self._params
        ours = {i["ImageId"] for i in self.images}
        if params.get("Owners") != ["amazon"] and not (params.get("ImageIds") and set(params["ImageIds"]) <= ours):
            return None  # to moto
        found = [i for i in self.images if not params.get("ImageIds") or i["ImageId"] in params["ImageIds"]]
        for f in params.get("Filters", []):
            key = {"name": "Name", "description": "Description", "state": "State"}[f["Name"]]
            found = [i for i in found if any(fnmatch.fnmatchcase(i[key], v) for v in f["Values"])]
        return _answer({"Images": found})


@pytest.fixture
def dlamis(session, public_parameters) -> PublicImages:
    images = PublicImages()
    images.install(session)
    images.add("ami-0a231", "Deep Learning AMI Neuron (Ubuntu 24.04) 20260801", "2.31.0", "2026-08-01T00:00:00Z")
    images.add("ami-0a320", "Deep Learning AMI Neuron (Ubuntu 24.04) 20261006", "2.32.0", "2026-10-06T00:00:00Z")
    images.add("ami-0a321", "Deep Learning AMI Neuron (Ubuntu 24.04) 20261020", "2.32.0", "2026-10-20T00:00:00Z")
    images.add("ami-0a330", "Deep Learning AMI Neuron (Ubuntu 26.04) 20261201", "2.33.0", "2026-12-01T00:00:00Z")
    public_parameters.values[LATEST] = "ami-0a321"  # the 24.04 parameter stopped at 2.32
    return images


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The Session Manager plugin where Packer runs (a stand-in: only its presence is checked)."""
    bin_dir = tmp_path / "plugin-bin"
    bin_dir.mkdir()
    (bin_dir / "session-manager-plugin").write_text("#!/bin/sh\n")
    (bin_dir / "session-manager-plugin").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def cloud_of(session) -> Cloud:
    return Cloud(session, log=io.StringIO())


def settings(*argv: str) -> bake.BakeSettings:
    return bake.parse_packer_args(list(argv))


def test_packer_arguments_are_read_as_packer_reads_them():
    found = settings("-only=amazon-ebs.neuron", "-var", "subnet_id=subnet-0abc", "-var=builder_connect=public_ip",
                     "-except", "amazon-ebs.cuda", "-var", "neuron_sdk_version=2.33.0")
    assert found.sources == ("amazon-ebs.neuron",)
    assert found.get("subnet_id") == "subnet-0abc" and found.get("builder_connect") == "public_ip"
    assert found.get("neuron_sdk_version") == "2.33.0" and found.get("region") == "us-east-2"
    assert settings("-only=amazon-ebs.cuda").sources == ("amazon-ebs.cuda",)


def test_the_bake_starts_from_the_newest_dlami_of_the_pinned_sdk(session, dlamis, network, plugin):
    said = bake.check(cloud_of(session), settings("-var", f"subnet_id={network['subnet_id']}"))
    assert said[-1] == "Trainium AMI from ami-0a321 (Deep Learning AMI Neuron (Ubuntu 24.04) 20261020, Neuron SDK 2.32.0)"


def test_a_pinned_sdk_without_a_dlami_here_is_refused_naming_the_releases_there_are(session, dlamis, network, plugin):
    with pytest.raises(bake.BakeRefused) as err:
        bake.check(cloud_of(session), settings("-var", f"subnet_id={network['subnet_id']}",
                                               "-var", "neuron_sdk_version=2.33.0"))
    message = str(err.value)
    assert "no Neuron DLAMI of SDK 2.33.0 named 'Deep Learning AMI Neuron (Ubuntu 24.04) *'" in message
    assert "are of Neuron SDK 2.31.0, 2.32.0" in message and "neuron_dlami_name" in message
    said = bake.check(cloud_of(session), settings(  # the release's own OS: found
        "-var", f"subnet_id={network['subnet_id']}", "-var", "neuron_sdk_version=2.33.0",
        "-var", "neuron_dlami_name=Deep Learning AMI Neuron (Ubuntu 26.04) *"))
    assert "ami-0a330" in said[-1]


def test_a_newer_sdk_on_the_latest_parameter_is_said(session, dlamis, network, plugin, public_parameters):
    dlamis.add("ami-0a335", "Deep Learning AMI Neuron (Ubuntu 24.04) 20261205", "2.33.0", "2026-12-05T00:00:00Z")
    public_parameters.values[LATEST] = "ami-0a335"
    cloud = cloud_of(session)
    bake.check(cloud, settings("-var", f"subnet_id={network['subnet_id']}"))
    assert "is of Neuron SDK 2.33.0; this bake pins 2.32.0 (-var neuron_sdk_version=2.33.0 to move)" in cloud.log.getvalue()


def test_a_pinned_ami_of_another_sdk_is_refused(session, dlamis, network, plugin):
    with pytest.raises(bake.BakeRefused, match="ami-0a231 .* is a DLAMI of Neuron SDK 2.31.0, not of "
                                               "neuron_sdk_version 2.32.0"):
        bake.check(cloud_of(session), settings("-var", f"subnet_id={network['subnet_id']}",
                                               "-var", "neuron_source_ami=ami-0a231"))


def test_without_a_default_vpc_the_bake_asks_for_a_subnet(session, ec2, dlamis, plugin):
    delete_default_vpc(ec2)
    with pytest.raises(bake.BakeRefused, match=f"{REGION} has no default VPC, and no subnet_id was given: pass -var "
                                               "subnet_id=subnet-..."):
        bake.check(cloud_of(session), settings())


def test_a_private_subnet_with_a_nat_gateway_bakes_through_session_manager(session, network, dlamis, plugin):
    said = bake.check(cloud_of(session), settings("-var", f"subnet_id={network['subnet_id']}"))
    assert said[0] == f"builder network: {network['subnet_id']} (Session Manager)"


def test_session_manager_needs_its_plugin_here(session, network, dlamis, monkeypatch):
    monkeypatch.setattr(bake.shutil, "which", lambda name: None)
    with pytest.raises(bake.BakeRefused, match="Session Manager plugin is not installed here.*builder_connect=public_ip"):
        bake.check(cloud_of(session), settings("-var", f"subnet_id={network['subnet_id']}"))


def test_a_public_ip_needs_a_subnet_routed_to_an_internet_gateway(session, ec2, network, dlamis):
    with pytest.raises(bake.BakeRefused, match="routes 0.0.0.0/0 to no internet gateway"):
        bake.check(cloud_of(session), settings("-var", f"subnet_id={network['subnet_id']}",
                                               "-var", "builder_connect=public_ip"))
    public = ec2.create_subnet(VpcId=network["vpc_id"], CidrBlock="10.20.9.0/24",
                               AvailabilityZone=network["zone"])["Subnet"]["SubnetId"]
    table = ec2.create_route_table(VpcId=network["vpc_id"])["RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", GatewayId=network["igw"])
    ec2.associate_route_table(RouteTableId=table, SubnetId=public)
    said = bake.check(cloud_of(session), settings("-var", f"subnet_id={public}", "-var", "builder_connect=public_ip"))
    assert said[0] == f"builder network: {public} (public IP)"


def delete_default_vpc(ec2) -> None:
    default = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    for subnet in ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [default]}])["Subnets"]:
        ec2.delete_subnet(SubnetId=subnet["SubnetId"])
    ec2.delete_vpc(VpcId=default)


def test_build_sh_stops_before_packer_builds_when_the_check_refuses(aws_env, ec2, tmp_path):
    """The real ami/build.sh against moto, in a region without a default VPC and no subnet given, with
    a Packer stand-in that records what it is asked: it is never asked to build."""
    delete_default_vpc(ec2)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "packer").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/packer.log\n')
    (bin_dir / "packer").chmod(0o755)
    (bin_dir / "session-manager-plugin").write_text("#!/bin/sh\n")
    (bin_dir / "session-manager-plugin").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(AMI / "build.sh"), "-only=amazon-ebs.neuron", "-var", f"region={REGION}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"{REGION} has no default VPC" in done.stderr and "not baking" in done.stderr
    assert not (tmp_path / "packer.log").exists()


# -- AMIs copied to another region --------------------------------------------------------------------------

def test_an_ami_copied_without_its_tags_is_found_by_its_name_and_tagging_it_is_said(session, ec2, cloud):
    """CopyImage copies no tags unless asked (moto's copy_image, like EC2's, copies none)."""
    west = session.client("ec2", region_name="us-west-2")
    name = "neuron-disagg-neuron-0.1.0-20261206-101010"
    source = register_image(west, name, "neuron")
    copy = ec2.copy_image(SourceImageId=source, SourceRegion="us-west-2", Name=name)["ImageId"]
    assert ec2.describe_images(ImageIds=[copy])["Images"][0].get("Tags", []) == []
    image, where = ami.resolve(cloud, "neuron")
    assert image == copy and "baked" in where
    assert f"--resources {copy} --tags Key=neuron-disagg:platform,Value=neuron" in cloud.log.getvalue()
    assert ami.resolve(cloud, "neuron", override=copy) == (copy, "ami_id in the deployment config")
    with pytest.raises(ami.AmiWrongPlatform):  # its name says Neuron: refused for GPU instances
        ami.resolve(cloud, "cuda", override=copy)


def test_a_copy_under_another_name_is_refused_saying_how_to_copy_or_tag_it(session, ec2, cloud):
    west = session.client("ec2", region_name="us-west-2")
    source = register_image(west, "neuron-disagg-neuron-0.1.0-20261206-101010", "neuron")
    ec2.copy_image(SourceImageId=source, SourceRegion="us-west-2", Name="my-copy")
    with pytest.raises(ami.AmiNotFound) as err:
        ami.resolve(cloud, "neuron")
    assert "--copy-image-tags" in str(err.value) and "aws ec2 create-tags" in str(err.value)


# -- apt and a fresh DLAMI's own apt jobs -------------------------------------------------------------------

@pytest.mark.integration  # runs the provisioning script
def test_the_fabric_libs_step_waits_for_apts_lock(tmp_path):
    """40-fabric-libs.sh on a host without a compiler: apt-get (a stand-in that records) is told to
    wait for the lock, as 50-units.sh's is."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/apt.log\n')
    (bin_dir / "apt-get").chmod(0o755)
    fake = tmp_path / "neuron-disagg"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/neuron-disagg.log\n')
    fake.chmod(0o755)
    env = {"PATH": str(bin_dir), "PLATFORM": "neuron", "LIB_DIR": str(tmp_path / "lib"), "NEURON_DISAGG": str(fake)}
    done = subprocess.run(["/bin/bash", str(AMI / "scripts/40-fabric-libs.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "apt.log").read_text().splitlines() == [
        "-o DPkg::Lock::Timeout=300 update", "-o DPkg::Lock::Timeout=300 install -y gcc"]
    assert "install-fabric-libs --platform neuron" in (tmp_path / "neuron-disagg.log").read_text()
    units = (AMI / "scripts/50-units.sh").read_text()
    assert units.count("apt-get -o DPkg::Lock::Timeout=300") == 2


def test_install_fabric_libs_waits_for_apts_lock_when_it_fetches_hwloc(tmp_path, monkeypatch):
    ran: list[list[str]] = []

    def run(command, cwd, what):
        ran.append(command)
        if len(ran) == 1:  # stale package lists: the download fails once, as root an update follows
            raise fabric_libs.FabricLibsError("E: Unable to locate package libhwloc15")
        if command[-1] == "libhwloc15":
            Path(cwd, "libhwloc15_2.10.0-1_amd64.deb").write_bytes(b"")

    monkeypatch.setattr(fabric_libs, "_run", run)
    monkeypatch.setattr(fabric_libs.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(fabric_libs.os, "geteuid", lambda: 0)
    with pytest.raises(fabric_libs.FabricLibsError, match="holds no libhwloc.so.15"):  # dpkg-deb stood in
        fabric_libs._hwloc(tmp_path)
    apt = [command for command in ran if command[0] == "apt-get"]
    assert [command[3:] for command in apt] == [["download", "libhwloc15"], ["update", "-q"], ["download", "libhwloc15"]]
    assert all(command[1:3] == ["-o", "DPkg::Lock::Timeout=300"] for command in apt)
