"""The one door to AWS: every call of launch, status and teardown goes through ``Cloud.call``.

Why one door: ``--dry-run`` swaps in ``DryRunCloud``, which prints each call (operation and
parameters as JSON) and makes none, so what is printed is exactly what would be sent; and AWS's
error codes are turned into typed errors with advice in one place. The endpoint is boto3's own
(``AWS_ENDPOINT_URL`` works, which is how the tests point everything at a local moto server).
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import (BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError,
                                 NoRegionError)
from botocore import xform_name

from .errors import (AwsCallFailed, DeployError, MissingCredentials, NoCapacity, PermissionDenied,
                     QuotaExceeded, ReservationUnusable, UnsupportedInstanceType)

_CREDENTIAL_CODES = {"AuthFailure", "UnrecognizedClientException", "InvalidClientTokenId", "ExpiredToken",
                     "RequestExpired", "SignatureDoesNotMatch", "InvalidAccessKeyId"}
_HOW_TO_GET_CREDENTIALS = (
    "configure AWS credentials first: `aws configure` (access keys), `aws sso login --profile P` then "
    "AWS_PROFILE=P, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN in the environment")


def capacity_advice(instance_type: str) -> str:
    return (f"AWS has no free {instance_type} capacity in this subnet's Availability Zone right now. "
            f"Options: reserve a Capacity Block (`neuron-disagg launch CONFIG --capacity-block-offerings "
            f"HOURS` lists offers for {instance_type}; purchase one, then pass --capacity-block cr-... or set "
            "capacity_block_id), choose a subnet in another Availability Zone (--subnet), or retry later.")


def translate(exc: ClientError, operation: str, params: dict[str, Any]) -> DeployError:
    """AWS's error code -> the typed error whose message says what to do."""
    error = exc.response.get("Error", {})
    code, message = error.get("Code", "Unknown"), error.get("Message", str(exc))
    instance_type = params.get("InstanceType") or ", ".join(params.get("InstanceTypes", [])) or "this instance type"
    if code in _CREDENTIAL_CODES:
        return MissingCredentials(f"AWS rejected the credentials ({code}: {message}); {_HOW_TO_GET_CREDENTIALS}")
    if code in ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException"):
        return PermissionDenied(f"the credentials may not call {operation} ({code}); add that action to the "
                                "IAM policy of this user or role (see examples/README.md for the full list)")
    reserved = params.get("CapacityReservationSpecification", {}).get("CapacityReservationTarget", {})
    if code == "ReservationCapacityExceeded" or (reserved and code == "InsufficientInstanceCapacity"):
        # Buying capacity is not the fix: the reservation named is full (or another launch holds it).
        return ReservationUnusable(f"capacity reservation {reserved.get('CapacityReservationId', '?')} has no free "
                                   f"{instance_type} left ({code}: {message}); see its instances with `aws ec2 "
                                   "describe-capacity-reservations`, stop what runs in it, or use a larger one")
    if code in ("InsufficientInstanceCapacity", "InsufficientCapacityOnHost", "InsufficientCapacity"):
        return NoCapacity(capacity_advice(instance_type) + f" (AWS said: {message})")
    if code in ("InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded"):
        return QuotaExceeded(f"the account's quota does not allow another {instance_type} ({code}: {message}); "
                             "request an increase in Service Quotas (EC2 > 'Running On-Demand Trn instances' or "
                             "'... P instances'), or use a Capacity Block, which needs no on-demand quota")
    if "instance profile" in message.lower() or "iaminstanceprofile" in message.lower():
        profile = params.get("IamInstanceProfile", {}).get("Name", "the instance profile")
        return AwsCallFailed(operation, code, f"{message}. Check that instance profile {profile} exists in this "
                             "account (examples/README.md, step 2, creates one; a profile created seconds ago "
                             "may need a few more before EC2 accepts it)")
    if code == "InvalidInstanceType":
        return UnsupportedInstanceType(f"{instance_type} is not an instance type in this region ({message}); "
                                       "check the spelling")
    if code == "Unsupported":
        return UnsupportedInstanceType(f"{instance_type} cannot be used here ({code}: {message}); check the "
                                       "type's spelling and that the Availability Zone of the subnet offers it")
    return AwsCallFailed(operation, code, message)


#: Services answered from one region only, whatever the deployment's.
SERVICE_REGIONS = {"pricing": "us-east-1"}
# Services whose answers are advisory (the cost shown before a launch): one retry, not four with
# backoff, so an endpoint that errors delays a launch by a moment, not by seconds per instance type.
ADVISORY_SERVICES = frozenset({"pricing"})


class Cloud:
    """Real calls through a boto3 session."""

    dry_run = False

    def __init__(self, session: boto3.Session, log: TextIO | None = None, clients: dict[str, Any] | None = None):
        self.session = session
        self.region = session.region_name
        self.log = log or sys.stderr
        self._clients: dict[str, Any] = dict(clients or {})  # service -> client; tests may pass stubbed ones
        self._config = BotoConfig(retries={"mode": "standard", "max_attempts": 5})
        self._advisory_config = BotoConfig(retries={"mode": "standard", "max_attempts": 2})

    @classmethod
    def connect(cls, region: str, session: boto3.Session | None = None, log: TextIO | None = None) -> Cloud:
        """A cloud for ``region`` whose credentials are known to exist (checked without a call)."""
        try:
            session = session or boto3.Session(region_name=region)
        except BotoCoreError as exc:  # e.g. AWS_PROFILE names a profile that does not exist
            raise MissingCredentials(f"{exc}; {_HOW_TO_GET_CREDENTIALS}") from None
        if session.region_name != region:
            session = boto3.Session(botocore_session=session._session, region_name=region)
        if session.get_credentials() is None:
            raise MissingCredentials(f"no AWS credentials found; {_HOW_TO_GET_CREDENTIALS}")
        return cls(session, log)

    def client(self, service: str) -> Any:
        if service not in self._clients:
            try:
                region = SERVICE_REGIONS.get(service)  # None: the session's
                config = self._advisory_config if service in ADVISORY_SERVICES else self._config
                self._clients[service] = self.session.client(service, config=config, region_name=region)
            except NoRegionError:
                raise DeployError("no AWS region: set region in the deployment config or pass --region") from None
        return self._clients[service]

    def call(self, service: str, operation: str, **params: Any) -> dict[str, Any] | None:
        """Make one AWS call (``operation`` in the API's spelling, e.g. ``RunInstances``)."""
        try:
            return getattr(self.client(service), xform_name(operation))(**params)
        except ClientError as exc:
            raise translate(exc, operation, params) from None
        except NoCredentialsError:
            raise MissingCredentials(f"no AWS credentials found; {_HOW_TO_GET_CREDENTIALS}") from None
        except EndpointConnectionError as exc:
            raise DeployError(f"cannot reach AWS ({exc}); check the network and the region") from None

    def note(self, message: str) -> None:
        print(message, file=self.log, flush=True)

    def wait(self, seconds: float) -> None:
        import time

        time.sleep(seconds)


#: Parameters that may hold a secret, by call: the dry run prints them redacted whatever the caller
#: passed (the callers pass a placeholder already; this makes a slip there harmless).
SECRET_PARAMETERS: dict[tuple[str, str], tuple[str, ...]] = {("ssm", "PutParameter"): ("Value",)}
REDACTED = "<redacted>"


class DryRunCloud(Cloud):
    """Prints every call as one JSON line on ``out`` and returns None; needs no credentials.

    Callers treat None as "unknown until it runs" and carry on with a placeholder, so the dry run
    walks the same code path as the real one.
    """

    dry_run = True

    def __init__(self, region: str, out: TextIO | None = None, log: TextIO | None = None):
        self.region = region
        self.out = out or sys.stdout
        self.log = log or sys.stderr
        self.calls: list[dict[str, Any]] = []

    def call(self, service: str, operation: str, **params: Any) -> None:
        secret_keys = SECRET_PARAMETERS.get((service, operation), ())
        params = {key: REDACTED if key in secret_keys else value for key, value in params.items()}
        record = {"operation": f"{service}:{operation}", "parameters": params}
        self.calls.append(record)
        print(json.dumps(record, default=str), file=self.out, flush=True)
        return None

    def wait(self, seconds: float) -> None:
        return None


def placeholder(what: str) -> str:
    """A value only a real run would know, shown in dry-run output."""
    return f"<{what}>"
