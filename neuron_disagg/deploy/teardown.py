"""`neuron-disagg teardown`: terminate a deployment's instances, then delete what launch and
`instance-profile` created for it: the security groups (one per VPC it was launched into), the
placement group, every SecureString launch stored for it (under whatever name the config gave then:
they are found by their tags) and the per-deployment instance profile and role. Only what carries
the deployment's tags and says who created it is deleted, never something of the user's.
Idempotent: whatever is already gone is skipped, so a teardown interrupted halfway is finished by
running it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import instance_profile, network, secret_parameter
from .cloud import Cloud
from .errors import DeployError, PermissionDenied
from .inventory import find_instances


@dataclass
class TeardownResult:
    terminated: list[str] = field(default_factory=list)
    placement_group_deleted: bool = False
    security_groups_deleted: list[str] = field(default_factory=list)
    secret_parameters_deleted: list[str] = field(default_factory=list)  # their names
    instance_profile_deleted: bool = False

    @property
    def security_group_deleted(self) -> bool:
        return bool(self.security_groups_deleted)

    @property
    def secret_parameter_deleted(self) -> str:
        return ", ".join(self.secret_parameters_deleted)

    @property
    def anything(self) -> bool:
        return bool(self.terminated or self.placement_group_deleted or self.security_groups_deleted
                    or self.secret_parameters_deleted or self.instance_profile_deleted)


def teardown(cloud: Cloud, deployment: str, *, secret_parameter_name: str | None = None, timeout_s: float = 900,
             poll_s: float = 10, keep_instance_profile: bool = False) -> TeardownResult:
    """``secret_parameter_name``: the SecureString the config names now (``secret_parameter``); every other
    one launch stored for this deployment goes too. All are deleted last but the role, once no instance
    can still need them."""
    result = TeardownResult()
    live = find_instances(cloud, deployment)
    if live or cloud.dry_run:
        ids = [i["InstanceId"] for i in live] or ["<InstanceIds of the deployment>"]
        cloud.call("ec2", "TerminateInstances", InstanceIds=ids)
        result.terminated = [i for i in ids if not i.startswith("<")]
        for instance_id in result.terminated:
            cloud.note(f"terminating {instance_id}")
        _wait_terminated(cloud, deployment, timeout_s, poll_s)
    # A group cannot be deleted while instances (even shutting down) still use it.
    result.security_groups_deleted = network.delete_security_groups(cloud, deployment, timeout_s, poll_s)
    result.placement_group_deleted = network.delete_placement_group(cloud, deployment)
    if not cloud.dry_run:
        for group_id in result.security_groups_deleted:
            cloud.note(f"deleted security group {network.resource_name(deployment)} ({group_id})")
        if result.placement_group_deleted:
            cloud.note(f"deleted placement group {network.resource_name(deployment)}")
    names = secret_parameter.deployment_parameters(cloud, deployment)
    if secret_parameter_name and secret_parameter_name not in names:
        names.insert(0, secret_parameter_name)
    for name in names:
        if secret_parameter.delete(cloud, name, deployment):
            result.secret_parameters_deleted.append(name)
            if not cloud.dry_run:
                cloud.note(f"deleted SecureString {name}")
    if not keep_instance_profile:
        try:
            result.instance_profile_deleted = instance_profile.delete(cloud, deployment)
        except PermissionDenied as exc:  # the rest is gone; say what is left and how to remove it
            name = instance_profile.instance_role_name(deployment)
            cloud.note(f"could not delete instance profile and role {name} ({exc}); if `neuron-disagg "
                       f"instance-profile` created them, delete them in the IAM console or with `aws iam "
                       f"remove-role-from-instance-profile`, `delete-instance-profile`, `delete-role-policy`, "
                       f"`delete-role` (--role-name/--instance-profile-name {name})")
        if result.instance_profile_deleted and not cloud.dry_run:
            cloud.note(f"deleted instance profile and role {instance_profile.instance_role_name(deployment)} (a "
                       "relaunch needs `neuron-disagg instance-profile` again)")
    return result


def _wait_terminated(cloud: Cloud, deployment: str, timeout_s: float, poll_s: float) -> None:
    waited = 0.0
    while True:
        left = find_instances(cloud, deployment)
        if not left:
            return
        if waited >= timeout_s:
            raise DeployError(f"{len(left)} instance(s) of {deployment} still not terminated after {timeout_s:.0f} s "
                              f"({', '.join(i['InstanceId'] for i in left)}); run teardown again later")
        cloud.wait(poll_s)
        waited += poll_s
