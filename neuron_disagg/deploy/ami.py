"""Which AMI an instance boots: ours if one was baked, else the latest DLAMI.

Why this order: the AMI baked by ``ami/`` (tagged ``neuron-disagg:platform``) carries the EFA
software, NIXL, vLLM, this package and the systemd units that the user data starts; the plain
DLAMI boots but lacks our units, so launch refuses it unless ``allow_stock_ami`` says otherwise.

An AMI copied to another region by CopyImage has no tags unless the copy asked for them
(``--copy-image-tags``; ``ami_regions`` in the Packer template copies them). Such a copy is found by
the name the bake gave it (``neuron-disagg-<platform>-<version>-<stamp>``, which the console's copy
keeps), and launch says how to tag it.
"""

from __future__ import annotations

from typing import Any

from .cloud import Cloud, placeholder
from .errors import AmiNotFound, AmiWrongPlatform, AwsCallFailed, PermissionDenied
from .instance_types import Platform

PLATFORM_TAG = "neuron-disagg:platform"
#: What each platform's instances are, for messages.
PLATFORM_NAMES: dict[str, str] = {"neuron": "AWS Trainium/Inferentia (Neuron)", "cuda": "NVIDIA GPU (CUDA)"}
#: Public SSM parameters holding the latest DLAMI id (shared/notes/neuron-efa-aws.md).
DLAMI_PARAMETERS: dict[str, str] = {
    "neuron": "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id",
    "cuda": "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id",
}


def baked_name_prefix(platform: str) -> str:
    """What ami/neuron-disagg.pkr.hcl names its AMIs (ami_name) begin with."""
    return f"neuron-disagg-{platform}-"


def baked_image(cloud: Cloud, platform: Platform) -> str | None:
    """The newest available AMI of ours (owned by this account) for ``platform``: tagged so, else, for an
    untagged copy from another region, named so."""
    response = cloud.call("ec2", "DescribeImages", Owners=["self"], Filters=[
        {"Name": f"tag:{PLATFORM_TAG}", "Values": [platform]}, {"Name": "state", "Values": ["available"]}])
    if response is None:
        return None
    images = sorted(response.get("Images", []), key=lambda image: image.get("CreationDate", ""))
    if images:
        return images[-1]["ImageId"]
    response = cloud.call("ec2", "DescribeImages", Owners=["self"], Filters=[
        {"Name": "name", "Values": [baked_name_prefix(platform) + "*"]}, {"Name": "state", "Values": ["available"]}])
    copies = sorted((response or {}).get("Images", []), key=lambda image: image.get("CreationDate", ""))
    if not copies:
        return None
    image = copies[-1]
    cloud.note(f"{image['ImageId']} ({image.get('Name', '')}) is a neuron-disagg AMI by its name but has no tags: a copy "
               f"from another region made without --copy-image-tags. Tag it: aws ec2 create-tags --region "
               f"{cloud.region} --resources {image['ImageId']} --tags Key={PLATFORM_TAG},Value={platform}")
    return image["ImageId"]


def dlami(cloud: Cloud, platform: Platform) -> str:
    name = DLAMI_PARAMETERS[platform]
    try:
        response = cloud.call("ssm", "GetParameter", Name=name)
    except (AwsCallFailed, PermissionDenied) as exc:  # e.g. ParameterNotFound: say what it was for
        raise AmiNotFound(f"cannot read the DLAMI id from SSM parameter {name} ({exc}); set ami_id in the "
                          "deployment config, or bake an AMI with ami/build.sh") from None
    if response is None:
        return placeholder(f"ImageId: ssm:{name}")
    return response["Parameter"]["Value"]


def _describe(cloud: Cloud, image_id: str) -> dict[str, Any] | None:
    """DescribeImages of one image: None in a dry run or when it is not found."""
    response = cloud.call("ec2", "DescribeImages", ImageIds=[image_id])
    images = [] if response is None else response.get("Images", [])
    return images[0] if images else None


def image_platform(cloud: Cloud, image_id: str) -> str | None:
    """The value of the image's ``neuron-disagg:platform`` tag (``ami/`` bakes it in), else the platform its
    name says for an untagged copy of ours; None if neither."""
    image = _describe(cloud, image_id) or {}
    tagged = next((tag.get("Value", "") for tag in image.get("Tags", []) if tag.get("Key") == PLATFORM_TAG), None)
    if tagged is not None:
        return tagged
    return next((platform for platform in PLATFORM_NAMES
                 if str(image.get("Name", "")).startswith(baked_name_prefix(platform))), None)


def is_baked(cloud: Cloud, image_id: str) -> bool:
    """Whether ``image_id`` carries our platform tag (``ami/`` bakes it in)."""
    return image_platform(cloud, image_id) is not None


def resolve(cloud: Cloud, platform: Platform, override: str | None = None, allow_stock: bool = False) -> tuple[str, str]:
    """(image id, where it came from). An image that is not a baked neuron-disagg AMI boots but never
    serves (the user data exits) while the instances bill: refused unless ``allow_stock``."""
    refuse = ("the instances would boot but not serve, billing all the while: the user data starts "
              "neuron-disagg's systemd units, which only a baked AMI has. Bake one with ami/build.sh "
              "(examples/README.md), or set allow_stock_ami: true to launch anyway (debugging an image)")
    if override:
        if cloud.dry_run:
            return override, "ami_id in the deployment config"
        baked_for = image_platform(cloud, override)
        if baked_for is not None and baked_for != platform:
            # One ami_id in a config shared between trn2 and p5en would boot one platform's image on the other.
            raise AmiWrongPlatform(
                f"ami_id {override} is a neuron-disagg AMI for {PLATFORM_NAMES.get(baked_for, baked_for)} instances "
                f"(tag {PLATFORM_TAG}={baked_for}), but these instances are {PLATFORM_NAMES.get(platform, platform)} "
                f"({platform}): they would boot without their accelerator's software, billing all the while. "
                f"Set ami_id to an AMI baked for {platform} (`ami/build.sh -only=amazon-ebs.{platform}` bakes one; "
                f"`aws ec2 describe-images --owners self --filters Name=tag:{PLATFORM_TAG},Values={platform}` "
                "lists yours), or leave ami_id unset so that launch picks the newest baked AMI of each platform")
        if baked_for is None and not allow_stock:
            raise AmiNotFound(f"ami_id {override} is not a neuron-disagg AMI (no {PLATFORM_TAG} tag): {refuse}")
        return override, "ami_id in the deployment config"
    image = baked_image(cloud, platform)
    if image:
        return image, f"baked neuron-disagg AMI (tag {PLATFORM_TAG}={platform})"
    if cloud.dry_run:
        dlami(cloud, platform)
        return (placeholder(f"ImageId: newest own AMI tagged {PLATFORM_TAG}={platform}"), "decided when it runs")
    if not allow_stock:
        raise AmiNotFound(f"no neuron-disagg AMI tagged {PLATFORM_TAG}={platform} (nor named "
                          f"{baked_name_prefix(platform)}*) in {cloud.region}; {refuse}. An AMI copied here from another "
                          "region keeps its tags only if copied with --copy-image-tags (or by the bake's ami_regions); "
                          f"tag a copy with `aws ec2 create-tags --resources ami-... --tags "
                          f"Key={PLATFORM_TAG},Value={platform}`")
    image = dlami(cloud, platform)
    cloud.note(f"WARNING: allow_stock_ami: using the plain DLAMI {image}, which lacks the neuron-disagg systemd "
               "units: the instances will boot but not serve.")
    return image, f"latest DLAMI (ssm:{DLAMI_PARAMETERS[platform]})"


def root_device(cloud: Cloud, image_id: str) -> str:
    """The image's root device name, whose volume launch sizes (``root_volume_gib``)."""
    return root_volume(cloud, image_id)[0]


def root_volume(cloud: Cloud, image_id: str) -> tuple[str, int | None]:
    """(root device name, size in GiB of the image's root snapshot) in one DescribeImages. The size is
    None where unknown (a dry run, an image without it); RunInstances refuses a root volume smaller
    than it, and only after the security group and the secret exist (preflight.check_root_volume)."""
    response = cloud.call("ec2", "DescribeImages", ImageIds=[image_id])
    if response is None:
        return placeholder("RootDeviceName of the image"), None
    images = response.get("Images", [])
    if not images:
        raise AmiNotFound(f"AMI {image_id} does not exist in {cloud.region} or is not shared with this account")
    image = images[0]
    device = image.get("RootDeviceName", "/dev/sda1")
    size = None
    for mapping in image.get("BlockDeviceMappings", []):
        if _same_device(mapping.get("DeviceName", ""), device) and "VolumeSize" in mapping.get("Ebs", {}):
            size = int(mapping["Ebs"]["VolumeSize"])
    return device, size


def _same_device(a: str, b: str) -> bool:
    """/dev/sda1 and sda1 name one device (both spellings occur in AMIs' mappings)."""
    return a.removeprefix("/dev/") == b.removeprefix("/dev/")
