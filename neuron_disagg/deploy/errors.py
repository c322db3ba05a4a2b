"""Typed deployment errors. Each message says what to do next, because the person reading it is
at a terminal with a half-built deployment and a bill running."""

from __future__ import annotations


class DeployError(Exception):
    """Base class: the CLI prints the message and exits with ``exit_code``."""

    exit_code = 1


class DeploymentConfigError(DeployError):
    """The deployment config file (or a flag overriding it) is invalid or incomplete."""

    exit_code = 2


class MissingCredentials(DeployError):
    """No AWS credentials could be found, or AWS rejected the ones found."""

    exit_code = 3


class PermissionDenied(DeployError):
    """The credentials work but lack an IAM permission this step needs."""

    exit_code = 3


class UnsupportedInstanceType(DeployError):
    """The instance type does not exist or has no EFA, so KV cannot move over RDMA."""

    exit_code = 2


class NoCapacity(DeployError):
    """AWS has no free instances of this type in this Availability Zone right now."""

    exit_code = 4


class QuotaExceeded(DeployError):
    """The account's vCPU quota for this instance family is too small."""

    exit_code = 4


class ReservationUnusable(DeployError):
    """The capacity reservation named for a group cannot take these instances (type, zone, state, room)."""

    exit_code = 4


class AmiNotFound(DeployError):
    """Neither a baked neuron-disagg AMI nor the DLAMI parameter could be found."""


class AmiWrongPlatform(AmiNotFound):
    """The AMI named (ami_id) was baked for the other platform (Neuron vs CUDA) than the instances'."""

    exit_code = 2


class LaunchLimitExceeded(DeployError):
    """The launch would break a limit EC2 checks only once it runs: user data size, tags per resource,
    a root volume smaller than the image's snapshot. Found before anything is created."""

    exit_code = 2


class DeploymentExists(DeployError):
    """Instances of this deployment are already running; launching again would double them."""


class AwsCallFailed(DeployError):
    """An AWS call failed for a reason we have no specific advice for."""

    def __init__(self, operation: str, code: str, message: str):
        super().__init__(f"AWS {operation} failed: {code}: {message}")
        self.operation, self.code = operation, code
