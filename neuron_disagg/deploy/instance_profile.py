"""The instances' role: created per deployment (``neuron-disagg instance-profile``) and checked by
launch before anything bills.

Each instance reads its deployment's secret at boot with its instance profile's role. A profile
whose role may not read that SecureString boots instances that get AccessDenied and exit (and, since
issue 35, power off): the p5en walk-through used to do exactly that with the trn2 deployment's
profile. So launch reads the role's policies and refuses a profile that cannot read this
deployment's parameter, naming the profile it expects and how to create it. Reading IAM needs
``iam:GetInstanceProfile``, ``iam:ListRolePolicies``, ``iam:GetRolePolicy``,
``iam:ListAttachedRolePolicies``, ``iam:GetPolicy`` and ``iam:GetPolicyVersion``; without them launch
warns and goes on. The check reads Allow and Deny statements' actions and resources; conditions,
permission boundaries and SCPs it cannot see, so it refuses only what certainly cannot work.
"""

from __future__ import annotations

import fnmatch
import json
import urllib.parse
from typing import Any, Iterator

from .cloud import Cloud
from .errors import AwsCallFailed, DeploymentConfigError, PermissionDenied
from .settings import (SESSIONS_POLICY, TRUST_POLICY, DeploymentConfig, instance_role_name,
                       missing_instance_profile_advice, secret_policy)

class ProfileCannotReadSecret(DeploymentConfigError):
    """The instance profile's role may not read this deployment's secret."""


def create(cloud: Cloud, deployment: DeploymentConfig, sessions: bool = True) -> str:
    """Creates (or completes) ``neuron-disagg-<deployment>``: role, its policies, the instance
    profile holding it. Idempotent. Returns the profile's name."""
    name = instance_role_name(deployment.name)
    tags = [{"Key": k, "Value": v} for k, v in sorted(deployment.resource_tags().items())]
    _unless_exists(cloud, "CreateRole", RoleName=name, AssumeRolePolicyDocument=json.dumps(TRUST_POLICY), Tags=tags)
    cloud.call("iam", "PutRolePolicy", RoleName=name, PolicyName="neuron-disagg-secret",
               PolicyDocument=json.dumps(secret_policy(deployment.secret_parameter)))
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
    """Refuses an instance profile that cannot read this deployment's secret (see the module's text)."""
    profile_name = deployment.iam_instance_profile
    if deployment.secret_in_user_data or not profile_name or cloud.dry_run:
        return
    expected = instance_role_name(deployment.name)
    advice = missing_instance_profile_advice(deployment.secret_parameter, deployment.name).split("\n", 1)[1]
    create_it = (f"`neuron-disagg instance-profile CONFIG --name {deployment.name}` creates {expected}, "
                 f"which can; or:\n{advice}")
    try:
        profile = cloud.call("iam", "GetInstanceProfile", InstanceProfileName=profile_name)
        target = _parameter_arn(cloud, deployment)
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
    if not _allows(statements, "ssm:GetParameter", target):
        raise ProfileCannotReadSecret(
            f"instance profile {profile_name} cannot be deployment {deployment.name}'s: no policy of its role "
            f"({', '.join(roles)}) allows ssm:GetParameter on {deployment.secret_parameter}, so its instances "
            f"could not read the secret at boot. This deployment expects instance profile {expected}. " + create_it)


def _parameter_arn(cloud: Cloud, deployment: DeploymentConfig) -> str:
    identity = cloud.call("sts", "GetCallerIdentity") or {}
    return f"arn:aws:ssm:{cloud.region}:{identity.get('Account', '*')}:parameter{deployment.secret_parameter}"


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
