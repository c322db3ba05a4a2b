"""Which AMI an instance boots: ours if one was baked, else the latest DLAMI.

Why this order: the AMI baked by ``ami/`` (tagged ``neuron-disagg:platform``) carries the EFA
software, NIXL, vLLM, this package and the systemd units that the user data starts; the plain
DLAMI boots but lacks our units, so launch refuses it unless ``allow_stock_ami`` says otherwise.
"""

from __future__ import annotations

from .cloud import Cloud, placeholder
from .errors import AmiNotFound, AwsCallFailed, PermissionDenied
from .instance_types import Platform

PLATFORM_TAG = "neuron-disagg:platform"
#: Public SSM parameters holding the latest DLAMI id (shared/notes/neuron-efa-aws.md).
DLAMI_PARAMETERS: dict[str, str] = {
    "neuron": "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id",
    "cuda": "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id",
}


def baked_image(cloud: Cloud, platform: Platform) -> str | None:
    """The newest available AMI of ours (owned by this account) for ``platform``."""
    response = cloud.call("ec2", "DescribeImages", Owners=["self"], Filters=[
        {"Name": f"tag:{PLATFORM_TAG}", "Values": [platform]}, {"Name": "state", "Values": ["available"]}])
    if response is None:
        return None
    images = sorted(response.get("Images", []), key=lambda image: image.get("CreationDate", ""))
    return images[-1]["ImageId"] if images else None


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


def is_baked(cloud: Cloud, image_id: str) -> bool:
    """Whether ``image_id`` carries our platform tag (``ami/`` bakes it in)."""
    response = cloud.call("ec2", "DescribeImages", ImageIds=[image_id])
    images = [] if response is None else response.get("Images", [])
    return any(tag.get("Key") == PLATFORM_TAG for image in images for tag in image.get("Tags", []))


def resolve(cloud: Cloud, platform: Platform, override: str | None = None, allow_stock: bool = False) -> tuple[str, str]:
    """(image id, where it came from). An image that is not a baked neuron-disagg AMI boots but never
    serves (the user data exits) while the instances bill: refused unless ``allow_stock``."""
    refuse = (f"the instances would boot but not serve, billing all the while: the user data starts "
              "neuron-disagg's systemd units, which only a baked AMI has. Bake one with ami/build.sh "
              "(examples/README.md), or set allow_stock_ami: true to launch anyway (debugging an image)")
    if override:
        if not (cloud.dry_run or allow_stock or is_baked(cloud, override)):
            raise AmiNotFound(f"ami_id {override} is not a neuron-disagg AMI (no {PLATFORM_TAG} tag): {refuse}")
        return override, "ami_id in the deployment config"
    image = baked_image(cloud, platform)
    if image:
        return image, f"baked neuron-disagg AMI (tag {PLATFORM_TAG}={platform})"
    if cloud.dry_run:
        dlami(cloud, platform)
        return (placeholder(f"ImageId: newest own AMI tagged {PLATFORM_TAG}={platform}"), "decided when it runs")
    if not allow_stock:
        raise AmiNotFound(f"no neuron-disagg AMI tagged {PLATFORM_TAG}={platform} in {cloud.region}; {refuse}")
    image = dlami(cloud, platform)
    cloud.note(f"WARNING: allow_stock_ami: using the plain DLAMI {image}, which lacks the neuron-disagg systemd "
               "units: the instances will boot but not serve.")
    return image, f"latest DLAMI (ssm:{DLAMI_PARAMETERS[platform]})"


def root_device(cloud: Cloud, image_id: str) -> str:
    """The image's root device name, whose volume launch sizes (``root_volume_gib``)."""
    response = cloud.call("ec2", "DescribeImages", ImageIds=[image_id])
    if response is None:
        return placeholder("RootDeviceName of the image")
    images = response.get("Images", [])
    if not images:
        raise AmiNotFound(f"AMI {image_id} does not exist in {cloud.region} or is not shared with this account")
    return images[0].get("RootDeviceName", "/dev/sda1")
