"""The instances' role: created per deployment (``neuron-disagg instance-profile``), checked by
launch before anything bills, and deleted by teardown.

Each instance reads its deployment's secret at boot with its instance profile's role. A profile
whose role may not read that SecureString boots instances that get AccessDenied and power off:
the p5en walk-through once did exactly that with the trn2 deployment's profile. So launch reads the role's policies and refuses a profile that cannot read this
deployment's parameter, naming the profile it expects and how to create it. Reading IAM needs
``iam:GetInstanceProfile``, ``iam:ListRolePolicies``, ``iam:GetRolePolicy``,
``iam:ListAttachedRolePolicies``, ``iam:GetPolicy`` and ``iam:GetPolicyVersion``; without them launch
warns and goes on. The check reads Allow and Deny statements' actions and resources; conditions,
permission boundaries and SCPs it cannot see, so it refuses only what certainly cannot work. The
role may read the deployment's secret and, where the deployment names one, its Hugging Face token.

Role and profile are tagged with the deployment and ``neuron-disagg:created-by=instance-profile``;
teardown deletes them only when both tags say so (``find_ours``, ``delete``), and never one the user
made (an ``iam_instance_profile`` of their own is left alone).
"""

from __future__ import annotations

import fnmatch
import json
import urllib.parse
from typing import Any
from collections.abc import Iterator

from .cloud import Cloud
from .errors import AwsCallFailed, DeploymentConfigError, PermissionDenied
from .inventory import DEPLOYMENT_TAG, tags_of
from .network import CREATED_BY_TAG
from .settings import (SESSIONS_POLICY, TRUST_POLICY, DeploymentConfig, instance_role_name,
                       missing_instance_profile_advice, secret_policy)

CREATED_BY = "instance-profile"

class ProfileCannotReadSecret(DeploymentConfigError):
    """The instance profile's role may not read this deployment's secret."""


def create(cloud: Cloud, deployment: DeploymentConfig, sessions: bool = True) -> str:
    """Creates (or completes) ``neuron-disagg-<deployment>``: role, its policies, the instance
    profile holding it. Idempotent. Returns the profile's name."""
    name = instance_role_name(deployment.name)
    merged = {**deployment.resource_tags(), CREATED_BY_TAG: CREATED_BY}
    tags = [{"Key": k, "Value": v} for k, v in sorted(merged.items())]
    _unless_exists(cloud, "CreateRole", RoleName=name, AssumeRolePolicyDocument=json.dumps(TRUST_POLICY), Tags=tags)
    extra = (deployment.hf_token_ssm_parameter,) if deployment.hf_token_ssm_parameter else ()
    cloud.call("iam", "PutRolePolicy", RoleName=name, PolicyName="neuron-disagg-secret",
               PolicyDocument=json.dumps(secret_policy(deployment.secret_parameter, *extra)))
    if sessions:
        cloud.call("iam", "PutRolePolicy", RoleName=name, PolicyName="neuron-disagg-sessions",
                   PolicyDocument=json.dumps(SESSIONS_POLICY))
    _unless_exists(cloud, "CreateInstanceProfile", InstanceProfileName=name, Tags=tags)
    profile = cloud.call("iam", "GetInstanceProfile", InstanceProfileName=name)
    holds = [r["RoleName"] for r in (profile or {}).get("InstanceProfile", {}).get("Roles", [])]
    if name not in holds:
        cloud.call("iam", "AddRoleToInstanceProfile", InstanceProfileName=name, RoleName=name)
    return name


def _unless_exists(cloud: Cloud, operation: str, **params: Any) -> None:
    try:
        cloud.call("iam", operation, **params)
    except AwsCallFailed as exc:
        if exc.code != "EntityAlreadyExists":
            raise


def check(cloud: Cloud, deployment: DeploymentConfig) -> None:
    """Refuses an instance profile that cannot read what the instances read at boot: this deployment's
    secret and its Hugging Face token, where it names one (see the module's text)."""
    profile_name = deployment.iam_instance_profile
    if not deployment.parameters_read_at_boot or not profile_name or cloud.dry_run:
        return
    expected = instance_role_name(deployment.name)
    advice = missing_instance_profile_advice(deployment.secret_parameter, deployment.name,
                                             deployment.hf_token_ssm_parameter).split("\n", 1)[1]
    create_it = (f"`neuron-disagg instance-profile CONFIG --name {deployment.name}` creates {expected}, "
                 f"which can; or:\n{advice}")
    try:
        profile = cloud.call("iam", "GetInstanceProfile", InstanceProfileName=profile_name)
        account = (cloud.call("sts", "GetCallerIdentity") or {}).get("Account", "*")
        roles = [r["RoleName"] for r in profile["InstanceProfile"].get("Roles", [])]
        statements = [s for role in roles for s in _statements(cloud, role)]
    except PermissionDenied as exc:
        cloud.note(f"WARNING: cannot check that instance profile {profile_name} may read the secret ({exc}); "
                   "if it may not, the instances will power off at boot")
        return
    except AwsCallFailed as exc:
        if exc.code == "NoSuchEntity":
            raise ProfileCannotReadSecret(f"instance profile {profile_name} does not exist in this account. "
                                          + create_it) from None
        raise
    if not roles:
        raise ProfileCannotReadSecret(f"instance profile {profile_name} holds no role. " + create_it)
    for parameter in deployment.parameters_read_at_boot:
        target = f"arn:aws:ssm:{cloud.region}:{account}:parameter{parameter}"
        if not _allows(statements, "ssm:GetParameter", target):
            what = "the secret" if parameter == deployment.secret_parameter else "the Hugging Face token"
            raise ProfileCannotReadSecret(
                f"instance profile {profile_name} cannot be deployment {deployment.name}'s: no policy of its role "
                f"({', '.join(roles)}) allows ssm:GetParameter on {parameter}, so its instances could not read "
                f"{what} at boot. This deployment expects instance profile {expected}. " + create_it)


def find_ours(cloud: Cloud, deployment: str) -> dict[str, Any] | None:
    """``neuron-disagg-<deployment>``'s instance profile if `instance-profile` created it for this
    deployment (its tags say so); None if there is none, or it is someone else's, or in a dry run."""
    try:
        response = cloud.call("iam", "GetInstanceProfile", InstanceProfileName=instance_role_name(deployment))
    except AwsCallFailed as exc:
        if exc.code == "NoSuchEntity":
            return None
        raise
    if response is None:
        return None
    profile = response["InstanceProfile"]
    tags = tags_of(profile)
    if tags.get(DEPLOYMENT_TAG) != deployment or tags.get(CREATED_BY_TAG) != CREATED_BY:
        return None
    return profile


def delete(cloud: Cloud, deployment: str) -> bool:
    """Deletes the deployment's instance profile and its role, if `instance-profile` created them for
    this deployment (the role's tags are checked too): the profile first (it holds the role), then
    the role's inline and attached policies, then the role. Idempotent; True if anything went."""
    name = instance_role_name(deployment)
    if cloud.dry_run:
        for operation, params in (("RemoveRoleFromInstanceProfile", {"InstanceProfileName": name, "RoleName": name}),
                                  ("DeleteInstanceProfile", {"InstanceProfileName": name}),
                                  ("DeleteRolePolicy", {"RoleName": name, "PolicyName": "<each inline policy>"}),
                                  ("DeleteRole", {"RoleName": name})):
            cloud.call("iam", operation, **params)
        return True
    deleted = False
    profile = find_ours(cloud, deployment)
    if profile is not None:
        for role in profile.get("Roles", []):
            _gone_is_fine(cloud, "RemoveRoleFromInstanceProfile", InstanceProfileName=name, RoleName=role["RoleName"])
        deleted |= _gone_is_fine(cloud, "DeleteInstanceProfile", InstanceProfileName=name)
    try:
        role = cloud.call("iam", "GetRole", RoleName=name)["Role"]
    except AwsCallFailed as exc:
        if exc.code == "NoSuchEntity":
            return deleted
        raise
    tags = tags_of(role) or tags_of({"Tags": (cloud.call("iam", "ListRoleTags", RoleName=name) or {}).get("Tags", [])})
    if tags.get(DEPLOYMENT_TAG) != deployment or tags.get(CREATED_BY_TAG) != CREATED_BY:
        cloud.note(f"leaving IAM role {name}: it was not created by `neuron-disagg instance-profile` for {deployment}")
        return deleted
    holders = [p["InstanceProfileName"] for p in
               cloud.call("iam", "ListInstanceProfilesForRole", RoleName=name).get("InstanceProfiles", [])]
    if holders:
        cloud.note(f"leaving IAM role {name}: instance profile(s) {', '.join(holders)} still hold it")
        return deleted
    for policy in cloud.call("iam", "ListRolePolicies", RoleName=name).get("PolicyNames", []):
        _gone_is_fine(cloud, "DeleteRolePolicy", RoleName=name, PolicyName=policy)
    for policy in cloud.call("iam", "ListAttachedRolePolicies", RoleName=name).get("AttachedPolicies", []):
        _gone_is_fine(cloud, "DetachRolePolicy", RoleName=name, PolicyArn=policy["PolicyArn"])
    return _gone_is_fine(cloud, "DeleteRole", RoleName=name) or deleted


def _gone_is_fine(cloud: Cloud, operation: str, **params: Any) -> bool:
    """One IAM delete; something already gone (a teardown run twice) is not an error. True if it went."""
    try:
        cloud.call("iam", operation, **params)
    except AwsCallFailed as exc:
        if exc.code == "NoSuchEntity":
            return False
        raise
    return True


def _statements(cloud: Cloud, role: str) -> Iterator[dict[str, Any]]:
    for name in (cloud.call("iam", "ListRolePolicies", RoleName=role) or {}).get("PolicyNames", []):
        document = cloud.call("iam", "GetRolePolicy", RoleName=role, PolicyName=name)["PolicyDocument"]
        yield from _document(document).get("Statement", [])
    attached = (cloud.call("iam", "ListAttachedRolePolicies", RoleName=role) or {}).get("AttachedPolicies", [])
    for policy in attached:
        version = cloud.call("iam", "GetPolicy", PolicyArn=policy["PolicyArn"])["Policy"]["DefaultVersionId"]
        document = cloud.call("iam", "GetPolicyVersion", PolicyArn=policy["PolicyArn"],
                              VersionId=version)["PolicyVersion"]["Document"]
        yield from _document(document).get("Statement", [])


def _document(document: Any) -> dict[str, Any]:
    """boto3 hands IAM policy documents over parsed; the API's own form is URL-encoded JSON."""
    if isinstance(document, dict):
        return document
    return json.loads(urllib.parse.unquote(document))


def _listed(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _matches(patterns: list[str], value: str, ignore_case: bool = False) -> bool:
    """IAM's wildcards: * and ? (fnmatch's [...] escaped, as IAM has no such class)."""
    for pattern in patterns:
        pattern = pattern.replace("[", "[[]")
        if fnmatch.fnmatchcase(value.lower() if ignore_case else value, pattern.lower() if ignore_case else pattern):
            return True
    return False


def _allows(statements: list[dict[str, Any]], action: str, resource: str) -> bool:
    def applies(statement: dict[str, Any]) -> bool:
        return (_matches(_listed(statement.get("Action")), action, ignore_case=True)
                and _matches(_listed(statement.get("Resource")), resource))

    statements = [s for s in statements if isinstance(s, dict)]
    if any(s.get("Effect") == "Deny" and applies(s) for s in statements):
        return False
    return any(s.get("Effect") == "Allow" and applies(s) for s in statements)
