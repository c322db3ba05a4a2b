"""The deployment secret (the HMAC key of registrations) as an SSM SecureString: launch writes it,
each instance reads it at boot with its instance profile, teardown deletes it.

Why SSM rather than user data: user data is readable in clear by anyone allowed
ec2:DescribeInstanceAttribute in the account, while a SecureString is encrypted with KMS and readable
only by whoever may ssm:GetParameter it. Why the tags: like the placement and security groups, the
parameter carries ``neuron-disagg:deployment`` and ``neuron-disagg:created-by=launch``, and launch
overwrites (teardown deletes) only a parameter tagged so: a name someone else chose for their own
parameter is never clobbered. The value itself never reaches any output: not the dry run's (the
DryRunCloud redacts it too), not a log line, not an error message.
"""

from __future__ import annotations

from typing import Literal

from .cloud import Cloud, placeholder
from .errors import AwsCallFailed, DeployError, DeploymentConfigError, PermissionDenied
from .inventory import DEPLOYMENT_TAG, tag_list, tags_of
from .network import CREATED_BY_TAG

#: "ours": tagged by launch of this deployment; "foreign": exists, not ours; "missing": no such
#: parameter; "unknown": a dry run, or the credentials may not look.
State = Literal["ours", "foreign", "missing", "unknown"]
_MISSING_CODES = ("InvalidResourceId", "ParameterNotFound")


def state(cloud: Cloud, name: str, deployment: str) -> State:
    """Whether ``name`` exists and was created by launch of ``deployment`` (its tags say so).

    ListTagsForResource rather than GetParameter: it answers both questions and never returns the value.
    """
    try:
        response = cloud.call("ssm", "ListTagsForResource", ResourceType="Parameter", ResourceId=name)
    except AwsCallFailed as exc:
        if exc.code in _MISSING_CODES:
            return "missing"
        raise
    if response is None:
        return "unknown"
    tags = tags_of({"Tags": response.get("TagList", [])})
    return "ours" if tags.get(DEPLOYMENT_TAG) == deployment and tags.get(CREATED_BY_TAG) == "launch" else "foreign"


def store(cloud: Cloud, name: str, secret: bytes | None, deployment: str, tags: dict[str, str]) -> None:
    """Put ``secret`` into SecureString ``name`` (the account's default key, aws/ssm).

    Safe on relaunch: a parameter this deployment's launch created is overwritten (the secret may have
    changed; launch refuses to run while the deployment's instances do, so none still needs the old one)
    and its tags refreshed; a parameter of anyone else is left alone and launch stops. ``secret`` is
    None only in a dry run.
    """
    if secret is None:
        value = placeholder("the deployment secret, redacted")
    else:
        try:
            value = secret.decode("utf-8")
        except UnicodeDecodeError:
            raise DeploymentConfigError("the deployment secret is not text, and an SSM parameter holds text: "
                                        "create one with `openssl rand -hex 32`") from None
    found = state(cloud, name, deployment)
    if found == "foreign":
        raise DeployError(
            f"SSM parameter {name} exists but was not created by launch of {deployment} (it lacks the tags "
            f"{DEPLOYMENT_TAG}={deployment} and {CREATED_BY_TAG}=launch), so launch will not overwrite it: "
            "delete it, set secret_ssm_parameter to another name, or tag it with those two tags if it is "
            "meant to hold this deployment's secret")
    merged = {**tags, CREATED_BY_TAG: "launch"}
    common = {"Name": name, "Value": value, "Type": "SecureString",
              "Description": f"neuron-disagg deployment secret of {deployment} (HMAC key of KV registrations)"}
    if found == "ours":
        # AWS refuses Tags together with Overwrite: overwrite first, then refresh the tags.
        cloud.call("ssm", "PutParameter", **common, Overwrite=True)
        cloud.call("ssm", "AddTagsToResource", ResourceType="Parameter", ResourceId=name, Tags=tag_list(merged))
        cloud.note(f"overwrote SecureString {name} with the deployment secret")
        return
    cloud.call("ssm", "PutParameter", **common, Tags=tag_list(merged))
    if not cloud.dry_run:
        cloud.note(f"stored the deployment secret in SecureString {name}")


def delete(cloud: Cloud, name: str, deployment: str) -> bool:
    """Delete ``name`` if launch of ``deployment`` created it; True if it was deleted. A parameter
    already gone is not an error (teardown may run twice); one that is not ours is left alone, and so
    is one the credentials may not look at (said, so that nothing is left behind unnoticed)."""
    try:
        found = state(cloud, name, deployment)
    except PermissionDenied:
        cloud.note(f"could not check SSM parameter {name}: the credentials may not call ssm:ListTagsForResource; "
                   f"if launch stored the secret there, delete it with `aws ssm delete-parameter --name {name}`")
        return False
    if found == "missing":
        return False
    if found == "foreign":
        cloud.note(f"leaving SSM parameter {name}: it was not created by launch of {deployment}")
        return False
    try:
        cloud.call("ssm", "DeleteParameter", Name=name)
    except AwsCallFailed as exc:
        if exc.code in _MISSING_CODES:
            return False
        raise
    return True


def describe_state(cloud: Cloud, name: str, deployment: str) -> str:
    """One phrase for `status`; a missing permission to look is reported, not raised."""
    try:
        found = state(cloud, name, deployment)
    except PermissionDenied:
        return "unknown (the credentials may not call ssm:ListTagsForResource)"
    return {"ours": "exists (created by launch)", "foreign": "exists, not created by launch of this deployment",
            "missing": "does not exist", "unknown": "unknown"}[found]


def check_exists(cloud: Cloud, name: str, what: str) -> None:
    """Refuses a launch whose instances would read ``name`` at boot and find nothing (a SecureString the
    user creates, such as the Hugging Face token's): every vLLM start would fail and the hosts would
    bill until their deadline. DescribeParameters, which never returns a value."""
    try:
        response = cloud.call("ssm", "DescribeParameters",
                              ParameterFilters=[{"Key": "Name", "Option": "Equals", "Values": [name]}])
    except PermissionDenied:
        cloud.note(f"WARNING: cannot check that SecureString {name} ({what}) exists: the credentials may not call "
                   "ssm:DescribeParameters")
        return
    if response is None:
        return
    if not response.get("Parameters"):
        raise DeploymentConfigError(
            f"SecureString {name} ({what}) does not exist in {cloud.region}: create it, e.g. `aws ssm put-parameter "
            f"--name {name} --type SecureString --value hf_...` (a token from huggingface.co/settings/tokens), or "
            "drop hf_token_ssm_parameter for a model that is not gated")


def deployment_parameters(cloud: Cloud, deployment: str) -> list[str]:
    """Every parameter launch of ``deployment`` created (tagged so), whatever secret_ssm_parameter names
    now: a parameter left by a launch under an earlier name is found too. [] in a dry run or where the
    credentials may not look."""
    names: list[str] = []
    token: str | None = None
    filters = [{"Key": f"tag:{DEPLOYMENT_TAG}", "Values": [deployment]},
               {"Key": f"tag:{CREATED_BY_TAG}", "Values": ["launch"]}]
    while True:
        try:
            page = cloud.call("ssm", "DescribeParameters", ParameterFilters=filters,
                              **({"NextToken": token} if token else {}))
        except PermissionDenied:
            return names
        if page is None:
            return names
        names += [p["Name"] for p in page.get("Parameters", [])]
        token = page.get("NextToken")
        if not token:
            return sorted(names)
