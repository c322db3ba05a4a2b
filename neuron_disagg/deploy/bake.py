"""What ami/build.sh checks before Packer starts a builder that bills: the DLAMI the Trainium image
starts from is the pinned Neuron SDK release's, and the builder can be reached and can reach out.

    python -m neuron_disagg.deploy.bake [packer build's -var / -var-file / -only / -except arguments]

The DLAMI: AWS's SSM parameter for the Neuron DLAMI names only the latest of one OS
(``.../ubuntu-24.04/latest``), which stops moving when a release moves to another OS, and a bake
from it would then get an old SDK without a word. So the template finds the DLAMI by the SDK release
in its description (``neuron_sdk_version``), and this check says, before anything runs, whether such
a DLAMI exists in the region, which releases do if not, and whether a newer one is out.

The network: Packer reaches the builder through Session Manager by default (``builder_connect``),
which needs the Session Manager plugin here and a subnet from which the builder reaches Systems
Manager; with ``public_ip`` the subnet must route to an internet gateway. Either way the builder
downloads packages. Without ``subnet_id`` the region's default VPC is used, which must exist.

The defaults below are the template's (tests/deploy/test_ami.py holds them equal).
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cloud import Cloud
from .errors import DeployError
from .preflight import reaches_out

#: ami/neuron-disagg.pkr.hcl's defaults.
DEFAULTS = {"region": "us-east-2", "neuron_sdk_version": "2.32.0",
            "neuron_dlami_name": "Deep Learning AMI Neuron (Ubuntu 24.04) *", "builder_connect": "session_manager"}
SOURCES = ("amazon-ebs.neuron", "amazon-ebs.cuda")
#: The Neuron DLAMI whose "latest" AWS keeps in SSM: read only to say whether a newer SDK is out.
LATEST_NEURON_PARAMETER = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"
SDK_IN_DESCRIPTION = re.compile(r"Neuron SDK (\d+(?:\.\d+)+)")
SESSION_MANAGER_PLUGIN = ("https://docs.aws.amazon.com/systems-manager/latest/userguide/"
                          "session-manager-working-with-install-plugin.html")


class BakeRefused(DeployError):
    """The bake would start a builder that bills and then fail, or would build from the wrong DLAMI."""

    exit_code = 2


@dataclass
class BakeSettings:
    variables: dict[str, str] = field(default_factory=lambda: dict(DEFAULTS))
    sources: tuple[str, ...] = SOURCES

    def get(self, name: str) -> str | None:
        return self.variables.get(name)


def parse_packer_args(argv: list[str]) -> BakeSettings:
    """The variables and sources of `packer build`'s arguments (the template's defaults for the rest)."""
    settings = BakeSettings()
    only: list[str] = []
    excluded: list[str] = []
    words = iter(argv)
    for word in words:
        name, _, inline = word.lstrip("-").partition("=")
        if not word.startswith("-") or name not in ("var", "var-file", "only", "except"):
            continue
        value = inline if inline or "=" in word else next(words, "")
        if name == "var":
            key, _, val = value.partition("=")
            settings.variables[key.strip()] = val
        elif name == "var-file":
            settings.variables.update(_var_file(Path(value)))
        elif name == "only":
            only += [v.strip() for v in value.split(",") if v.strip()]
        else:
            excluded += [v.strip() for v in value.split(",") if v.strip()]
    settings.sources = tuple(s for s in SOURCES if (not only or s in only) and s not in excluded)
    return settings


def _var_file(path: Path) -> dict[str, str]:
    """``name = "value"`` lines of a .pkrvars.hcl file (what this check reads; Packer reads the rest)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise BakeRefused(f"cannot read -var-file {path}: {exc.strerror}") from None
    return dict(re.findall(r'^\s*(\w+)\s*=\s*"([^"]*)"\s*$', text, flags=re.MULTILINE))


def sdk_of(image: dict[str, Any]) -> str | None:
    found = SDK_IN_DESCRIPTION.search(image.get("Description") or "")
    return found.group(1) if found else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def check_neuron_dlami(cloud: Cloud, settings: BakeSettings) -> str:
    """The DLAMI the Trainium image would start from; refuses if the pinned SDK has none here."""
    sdk, pattern = settings.get("neuron_sdk_version") or "", settings.get("neuron_dlami_name") or ""
    pinned = settings.get("neuron_source_ami")
    if pinned:
        images = (cloud.call("ec2", "DescribeImages", ImageIds=[pinned]) or {}).get("Images", [])
        if not images:
            raise BakeRefused(f"neuron_source_ami {pinned} does not exist in {cloud.region}")
        if sdk_of(images[0]) != sdk:
            raise BakeRefused(f"neuron_source_ami {pinned} ({images[0].get('Name', '')}) is a DLAMI of Neuron SDK "
                              f"{sdk_of(images[0]) or 'unknown'}, not of neuron_sdk_version {sdk}: Packer would refuse "
                              "it. Set neuron_sdk_version to its release, or drop neuron_source_ami")
        return f"{pinned} ({images[0].get('Name', '')}, Neuron SDK {sdk})"
    response = cloud.call("ec2", "DescribeImages", Owners=["amazon"], Filters=[
        {"Name": "name", "Values": [pattern]}, {"Name": "description", "Values": [f"*Neuron SDK {sdk}*"]},
        {"Name": "state", "Values": ["available"]}])
    if response is None:
        return "<decided when it runs>"
    images = sorted(response.get("Images", []), key=lambda i: i.get("CreationDate", ""))
    if not images:
        named = (cloud.call("ec2", "DescribeImages", Owners=["amazon"], Filters=[
            {"Name": "name", "Values": [pattern]}, {"Name": "state", "Values": ["available"]}]) or {}).get("Images", [])
        releases = sorted({v for v in map(sdk_of, named) if v}, key=_version)
        have = (f"DLAMIs named {pattern!r} here are of Neuron SDK {', '.join(releases)}" if releases else
                f"no DLAMI here is named {pattern!r} (another OS? set neuron_dlami_name)")
        raise BakeRefused(f"no Neuron DLAMI of SDK {sdk} named {pattern!r} in {cloud.region}: {have}. Set "
                          "-var neuron_sdk_version=X.Y.Z to one of them (and neuron_dlami_name where that release's "
                          "DLAMI runs another OS)")
    image = images[-1]
    _newer_release(cloud, sdk)
    return f"{image['ImageId']} ({image.get('Name', '')}, Neuron SDK {sdk})"


def _newer_release(cloud: Cloud, sdk: str) -> None:
    """Says when the latest Neuron DLAMI AWS names in SSM is of a newer SDK than the pinned one."""
    try:
        latest = (cloud.call("ssm", "GetParameter", Name=LATEST_NEURON_PARAMETER) or {}).get("Parameter", {})
        images = (cloud.call("ec2", "DescribeImages", ImageIds=[latest["Value"]]) or {}).get("Images", [])
    except (DeployError, KeyError):
        return
    newer = sdk_of(images[0]) if images else None
    if newer and _version(newer) > _version(sdk):
        cloud.note(f"note: the latest Ubuntu 24.04 Neuron DLAMI ({images[0]['ImageId']}) is of Neuron SDK {newer}; "
                   f"this bake pins {sdk} (-var neuron_sdk_version={newer} to move)")


def check_network(cloud: Cloud, settings: BakeSettings) -> str:
    """Where the builder runs, refusing a network in which Packer could not reach it or it could not
    reach out."""
    connect = settings.get("builder_connect") or ""
    if connect not in ("session_manager", "public_ip"):
        raise BakeRefused(f"builder_connect must be session_manager or public_ip, not {connect!r}")
    if connect == "session_manager" and shutil.which("session-manager-plugin") is None:
        raise BakeRefused("builder_connect is session_manager (the default) and the Session Manager plugin is not "
                          f"installed here: install it ({SESSION_MANAGER_PLUGIN}), or bake in a public subnet with "
                          "-var builder_connect=public_ip -var subnet_id=subnet-...")
    subnet_id = settings.get("subnet_id")
    if not subnet_id:
        vpcs = cloud.call("ec2", "DescribeVpcs", Filters=[{"Name": "isDefault", "Values": ["true"]}])
        if vpcs is not None and not vpcs.get("Vpcs"):
            raise BakeRefused(f"{cloud.region} has no default VPC, and no subnet_id was given: pass -var "
                              "subnet_id=subnet-... (a private subnet with a NAT gateway, as the instances use, works "
                              "with the default builder_connect=session_manager)")
        return "the default VPC"
    response = cloud.call("ec2", "DescribeSubnets", SubnetIds=[subnet_id])
    if response is None:
        return subnet_id
    subnet = response["Subnets"][0]
    tables = cloud.call("ec2", "DescribeRouteTables", Filters=[
        {"Name": "association.subnet-id", "Values": [subnet_id]}]).get("RouteTables", [])
    if not tables:
        tables = cloud.call("ec2", "DescribeRouteTables", Filters=[
            {"Name": "vpc-id", "Values": [subnet["VpcId"]]},
            {"Name": "association.main", "Values": ["true"]}]).get("RouteTables", [])
    routes = [r for t in tables[:1] for r in t.get("Routes", [])
              if r.get("DestinationCidrBlock") == "0.0.0.0/0" and r.get("State", "active") == "active"]
    via_igw = any(str(r.get("GatewayId", "")).startswith("igw-") for r in routes)
    if connect == "public_ip":
        if not via_igw:
            raise BakeRefused(f"builder_connect is public_ip but subnet {subnet_id} routes 0.0.0.0/0 to no internet "
                              "gateway: Packer could not reach the builder's public IP. Use a public subnet, or the "
                              "default builder_connect=session_manager in this one")
        return f"{subnet_id} (public IP)"
    if any(reaches_out(r) for r in routes) or (via_igw and subnet.get("MapPublicIpOnLaunch")):
        return f"{subnet_id} (Session Manager)"
    why = ("its default route is an internet gateway but it gives no public IP" if via_igw else
           "it has no default route that leads out of the VPC")
    raise BakeRefused(f"subnet {subnet_id} cannot carry the builder ({why}): it could reach neither Systems Manager, "
                      "through which Packer connects, nor the packages it installs. Use a private subnet with a NAT "
                      "gateway route, or a public one with -var builder_connect=public_ip")


def check(cloud: Cloud, settings: BakeSettings) -> list[str]:
    """Every check for the sources being built; what each found, for the bake's log."""
    said = [f"builder network: {check_network(cloud, settings)}"]
    if "amazon-ebs.neuron" in settings.sources:
        said.append(f"Trainium AMI from {check_neuron_dlami(cloud, settings)}")
    return said


def main(argv: list[str]) -> int:
    settings = parse_packer_args(argv)
    try:
        cloud = Cloud.connect(settings.get("region") or DEFAULTS["region"])
        for line in check(cloud, settings):
            print(f"ami/build.sh: {line}", file=sys.stderr)
    except DeployError as exc:
        print(f"ami/build.sh: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
