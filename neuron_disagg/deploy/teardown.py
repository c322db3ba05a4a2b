"""`neuron-disagg teardown`: terminate a deployment's instances, then delete the placement group,
the security group and the secret's SSM parameter that launch created. Idempotent: whatever is
already gone is skipped, so a teardown interrupted halfway is finished by running it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import network, secret_parameter
from .cloud import Cloud
from .errors import DeployError
from .inventory import find_instances


@dataclass
class TeardownResult:
    terminated: list[str] = field(default_factory=list)
    placement_group_deleted: bool = False
    security_group_deleted: bool = False
    secret_parameter_deleted: str = ""  # its name, if it was deleted

    @property
    def anything(self) -> bool:
        return bool(self.terminated or self.placement_group_deleted or self.security_group_deleted
                    or self.secret_parameter_deleted)


def teardown(cloud: Cloud, deployment: str, *, secret_parameter_name: str | None = None, timeout_s: float = 900,
             poll_s: float = 10) -> TeardownResult:
    """``secret_parameter_name``: the SecureString launch stored the secret in (the deployment
    config's ``secret_parameter``); deleted last, once no instance can still need it."""
    result = TeardownResult()
    live = find_instances(cloud, deployment)
    if live or cloud.dry_run:
        ids = [i["InstanceId"] for i in live] or ["<InstanceIds of the deployment>"]
        cloud.call("ec2", "TerminateInstances", InstanceIds=ids)
        result.terminated = [i for i in ids if not i.startswith("<")]
        for instance_id in result.terminated:
            cloud.note(f"terminating {instance_id}")
        _wait_terminated(cloud, deployment, timeout_s, poll_s)
    # The group cannot be deleted while instances (even shutting down) still use it.
    result.security_group_deleted = network.delete_security_group(cloud, deployment, timeout_s, poll_s)
    result.placement_group_deleted = network.delete_placement_group(cloud, deployment)
    if result.security_group_deleted and not cloud.dry_run:
        cloud.note(f"deleted security group {network.resource_name(deployment)}")
    if result.placement_group_deleted and not cloud.dry_run:
        cloud.note(f"deleted placement group {network.resource_name(deployment)}")
    if secret_parameter_name and secret_parameter.delete(cloud, secret_parameter_name, deployment):
        result.secret_parameter_deleted = secret_parameter_name
        if not cloud.dry_run:
            cloud.note(f"deleted SecureString {secret_parameter_name} (the deployment secret)")
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
