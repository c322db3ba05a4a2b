"""Fixtures for the deployment tests: moto as a real HTTP server process on 127.0.0.1, boto3 talking
to it through AWS_ENDPOINT_URL with dummy credentials, and stand-ins for the few things moto lacks.

What moto 5.2 lacks, and what stands in (each visible in the tests that use it):
- placement groups (CreatePlacementGroup etc. are NotImplemented): ``MotoGaps`` answers those three
  calls through botocore's ``before-call`` event, the mechanism botocore's Stubber uses; Stubber
  itself cannot stub some operations of a client and send the rest to moto.
- EFA interface types: moto accepts ``InterfaceType efa``/``efa-only`` and ``NetworkCardIndex`` but
  drops them (every interface comes back as ``interface`` on card 0), so ``MotoGaps`` also records
  each RunInstances request as serialized on the wire, and the layout tests read that.
- SSM ``/aws/...`` public parameters (the DLAMI ids): ``PublicParameters`` answers GetParameter of
  those the same way; every other SSM call (the deployment secret's SecureString) goes to moto.
- Service Quotas for EC2 (moto's holds the VPC quotas only): ``ServiceQuotas`` answers GetServiceQuota
  and GetAWSDefaultServiceQuota for EC2's vCPU quotas, shaped as AWS answers (tests/deploy/test_quotas.py
  also checks the shapes against botocore's model with its Stubber).
- Capacity Blocks: botocore's Stubber on the client.
- an InsufficientInstanceCapacity answer: ``MotoGaps.fail_run_instances``.
- failures moto never gives: CreateTags answering InvalidInstanceID.NotFound (EC2's eventual
  consistency) or any error (``create_tags_failures``), and a RunInstances whose answer is lost after
  the instances exist (``raise_after_run_instances``).
- serial console text: moto answers GetConsoleOutput with a fixed sample; ``console`` sets an instance's.
Never real AWS: every test runs with AWS_ENDPOINT_URL set, credentials ``testing`` and IMDS off.
"""

from __future__ import annotations

import base64
import datetime
import functools
import io
import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import boto3
import botocore.session
import pytest
import yaml
from botocore.awsrequest import AWSResponse

from neuron_disagg.deploy.cloud import Cloud
from neuron_disagg.local_cluster import free_port

REGION = "us-east-2"
SECRET = "0123456789abcdef0123456789abcdef"
INSTANCE_PROFILE = "nd-test"  # every test config names it; the instance_profile fixture creates it in moto


def wait_until_serving(url: str, process: subprocess.Popen, timeout_s: float, what: str) -> None:
    """Polls ``url`` until it answers; kills ``process`` and raises if it dies or takes too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


@pytest.fixture(scope="session", autouse=True)
def one_model_loader():
    """Every boto3 session of the tests shares one botocore loader, which keeps each service's API
    model once parsed. A session builds its own otherwise, and the tests (each with a session, and
    the CLI's own) spent about 35 s re-parsing the same JSON models (EC2's is several MB)."""
    made = botocore.session.create_loader
    botocore.session.create_loader = functools.lru_cache(maxsize=None)(made)
    yield
    botocore.session.create_loader = made


@pytest.fixture(scope="session")
def moto_url(tmp_path_factory):
    """One moto server process for the session; each test resets its state."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(f"{url}/moto-api/", process, 60, f"moto server (log {log.name})")
    yield url
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    log.close()


@pytest.fixture
def aws_env(moto_url, monkeypatch, tmp_path):
    """Environment pointing boto3 at moto with dummy credentials, and only that."""
    # A reset re-creates every service's backend: on two busy cores it once took over 10 s.
    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"), timeout=60).read()
    for var in list(os.environ):
        if var.startswith("AWS_") or var == "NEURON_DISAGG_SECRET":
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("NEURON_DISAGG_SECRET", SECRET)
    return moto_url


def _answer(parsed: dict[str, Any], status: int = 200) -> tuple[AWSResponse, dict[str, Any]]:
    parsed.setdefault("ResponseMetadata", {"HTTPStatusCode": status, "RequestId": "moto-gap"})
    return AWSResponse("http://moto-gap", status, {}, None), parsed


def error(code: str, message: str, status: int = 400) -> tuple[AWSResponse, dict[str, Any]]:
    return _answer({"Error": {"Code": code, "Message": message}}, status)


class MotoGaps:
    """Answers what moto does not implement and records what went over the wire."""

    def __init__(self) -> None:
        self.placement_groups: dict[str, dict[str, Any]] = {}
        self.run_instances_wire: list[dict[str, str]] = []  # each RunInstances request body, decoded
        self.fail_run_instances: tuple[str, str] | None = None  # (code, message) to answer instead
        self.fail_after: int = 0  # ... after this many RunInstances went through
        self.raise_on_run_instances: Exception | None = None  # raised instead, e.g. a read timeout
        self.capacity_reservations: dict[str, dict[str, Any]] = {}  # id -> DescribeCapacityReservations entry
        self.create_tags_failures: list[tuple[str, str]] = []  # (code, message) answered to the next CreateTags
        self.raise_after_run_instances: Exception | None = None  # raised once moto started them: an answer lost
        self.console: dict[str, str] = {}  # instance id -> its serial console text (moto's is a fixed sample)
        self._params: dict[str, Any] = {}

    def install(self, session: boto3.Session) -> None:
        events = session.events
        # before-call sees the serialized request; keep the API-level parameters from one step earlier.
        events.register("before-parameter-build.ec2.*", self._keep_params)
        events.register("before-call.ec2.CreatePlacementGroup", self._create)
        events.register("before-call.ec2.DescribePlacementGroups", self._describe)
        events.register("before-call.ec2.DeletePlacementGroup", self._delete)
        events.register("before-call.ec2.RunInstances", self._maybe_fail)
        events.register("before-call.ec2.DescribeCapacityReservations", self._reservations)
        events.register("before-send.ec2.RunInstances", self._record)
        events.register("after-call.ec2.RunInstances", self._launch_indexes)
        events.register("before-call.ec2.CreateTags", self._maybe_fail_tags)
        events.register("before-call.ec2.GetConsoleOutput", self._console_output)

    def _keep_params(self, params, **_):
        self._params = dict(params)

    def _create(self, **_):
        params = self._params
        name = params["GroupName"]
        if name in self.placement_groups:
            return error("InvalidPlacementGroup.Duplicate", f"The placement group '{name}' already exists.")
        tags = [t for spec in params.get("TagSpecifications", []) for t in spec.get("Tags", [])]
        self.placement_groups[name] = {"GroupName": name, "Strategy": params["Strategy"], "State": "available",
                                       "GroupId": f"pg-{len(self.placement_groups):017x}",
                                       "Tags": [{"Key": t["Key"], "Value": t["Value"]} for t in tags]}
        return _answer({"PlacementGroup": self.placement_groups[name]})

    def _describe(self, **_):
        params = self._params
        names = [v for f in params.get("Filters", []) if f["Name"] == "group-name" for v in f.get("Values", [])]
        groups = [g for n, g in self.placement_groups.items() if not names or n in names]
        return _answer({"PlacementGroups": groups})

    def _delete(self, **_):
        params = self._params
        if self.placement_groups.pop(params["GroupName"], None) is None:
            return error("InvalidPlacementGroup.Unknown", f"The Placement Group '{params['GroupName']}' is unknown.")
        return _answer({})

    def _reservations(self, **_):
        wanted = self._params.get("CapacityReservationIds", [])
        missing = [r for r in wanted if r not in self.capacity_reservations]
        if missing:
            return error("InvalidCapacityReservationId.NotFound", f"The capacity reservation ID '{missing[0]}' "
                                                                  "does not exist")
        return _answer({"CapacityReservations": [self.capacity_reservations[r] for r in wanted]})

    def reserve(self, reservation_id: str, instance_type: str, zone: str, *, capacity_block: bool = True,
                state: str = "active", free: int = 4, total: int = 4, hours_left: float | None = 24.0,
                placement_group: str | None = None) -> None:
        """``hours_left``: until the end time (a Capacity Block always has one; None: no end)."""
        entry = {
            "CapacityReservationId": reservation_id, "InstanceType": instance_type, "AvailabilityZone": zone,
            "State": state, "AvailableInstanceCount": free, "TotalInstanceCount": total,
            "ReservationType": "capacity-block" if capacity_block else "default",
            "StartDate": "2026-12-24T11:30:00+00:00"}
        if hours_left is not None:
            end = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=hours_left)
            entry.update(EndDate=end.isoformat(timespec="seconds"), EndDateType="limited")
        if placement_group:
            entry["PlacementGroupArn"] = f"arn:aws:ec2:{REGION}:123456789012:placement-group/{placement_group}"
        self.capacity_reservations[reservation_id] = entry

    def _maybe_fail(self, **_):
        if self.raise_on_run_instances is not None and len(self.run_instances_wire) >= self.fail_after:
            raise self.raise_on_run_instances
        if self.fail_run_instances and len(self.run_instances_wire) >= self.fail_after:
            return error(*self.fail_run_instances, status=500)
        return None

    def _maybe_fail_tags(self, **_):
        return error(*self.create_tags_failures.pop(0)) if self.create_tags_failures else None

    def _console_output(self, **_):
        instance_id = self._params["InstanceId"]
        if instance_id not in self.console:
            return None
        return _answer({"InstanceId": instance_id, "Output": base64.b64encode(self.console[instance_id].encode()).decode()})

    def _launch_indexes(self, parsed, **_):
        """moto leaves out each instance's AmiLaunchIndex (it creates them in that order); AWS does
        not promise the list's order: answer with the indexes, in reverse."""
        instances = parsed.get("Instances", [])
        for index, instance in enumerate(instances):
            instance["AmiLaunchIndex"] = index
        instances.reverse()
        if self.raise_after_run_instances is not None:
            raise self.raise_after_run_instances

    def _record(self, request, **_):
        body = request.body.decode() if isinstance(request.body, bytes) else request.body
        self.run_instances_wire.append(dict(urllib.parse.parse_qsl(body)))
        return None


class PublicParameters:
    """AWS's public ``/aws/service/...`` parameters (the DLAMI ids), which moto does not hold: set
    them in ``values``; GetParameter of an unset one answers ParameterNotFound, as AWS would. Other
    parameter names go to moto untouched. ``asked`` lists the public names looked up."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.asked: list[str] = []
        self._params: dict[str, Any] = {}

    def install(self, session: boto3.Session) -> None:
        session.events.register("before-parameter-build.ssm.GetParameter", self._keep_params)
        session.events.register("before-call.ssm.GetParameter", self._answer)

    def _keep_params(self, params, **_):
        self._params = dict(params)

    def _answer(self, **_):
        name = self._params.get("Name", "")
        if not name.startswith("/aws/"):
            return None  # to moto
        self.asked.append(name)
        if name not in self.values:
            return error("ParameterNotFound", f"Parameter {name} not found.")
        return _answer({"Parameter": {"Name": name, "Type": "String", "Value": self.values[name]}})


class ServiceQuotas:
    """EC2's vCPU quotas, which moto's Service Quotas lacks: ``applied`` (quota code -> vCPUs) answers
    GetServiceQuota, a code without an applied value answers NoSuchResourceException, as AWS does, and
    GetAWSDefaultServiceQuota answers ``defaults``. ``denied``: AccessDeniedException to both."""

    NAMES = {"L-2C3B7624": "Running On-Demand Trn instances", "L-417A185B": "Running On-Demand P instances",
             "L-1945791B": "Running On-Demand Inf instances"}

    def __init__(self) -> None:
        # Enough for every launch of the other tests; test_quotas.py sets what it checks.
        self.applied: dict[str, float] = {code: 100_000.0 for code in self.NAMES}
        self.defaults: dict[str, float] = {code: 0.0 for code in self.NAMES}
        self.denied = False
        self.asked: list[tuple[str, str]] = []  # (operation, quota code)
        self._params: dict[str, Any] = {}

    def install(self, session: boto3.Session) -> None:
        session.events.register("before-parameter-build.service-quotas.*", self._keep_params)
        session.events.register("before-call.service-quotas.GetServiceQuota", self._applied)
        session.events.register("before-call.service-quotas.GetAWSDefaultServiceQuota", self._default)

    def _keep_params(self, params, **_):
        self._params = dict(params)

    def quota(self, code: str, value: float) -> dict[str, Any]:
        return {"ServiceCode": "ec2", "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
                "QuotaArn": f"arn:aws:servicequotas:{REGION}:123456789012:ec2/{code}", "QuotaCode": code,
                "QuotaName": self.NAMES.get(code, code), "Value": value, "Unit": "None", "Adjustable": True,
                "GlobalQuota": False}

    def _applied(self, **_):
        code = self._params["QuotaCode"]
        self.asked.append(("GetServiceQuota", code))
        if self.denied:
            return error("AccessDeniedException", "User is not authorized to perform: servicequotas:GetServiceQuota")
        if self._params.get("ServiceCode") != "ec2" or code not in self.applied:
            return error("NoSuchResourceException", f"The request failed because the specified quota {code} does not exist.")
        return _answer({"Quota": self.quota(code, self.applied[code])})

    def _default(self, **_):
        code = self._params["QuotaCode"]
        self.asked.append(("GetAWSDefaultServiceQuota", code))
        if self.denied:
            return error("AccessDeniedException", "not authorized")
        return _answer({"Quota": self.quota(code, self.defaults.get(code, 0.0))})


@pytest.fixture
def gaps() -> MotoGaps:
    return MotoGaps()


@pytest.fixture
def service_quotas() -> ServiceQuotas:
    return ServiceQuotas()


@pytest.fixture
def public_parameters() -> PublicParameters:
    return PublicParameters()


@pytest.fixture
def session(aws_env, gaps, public_parameters, service_quotas) -> boto3.Session:
    s = boto3.Session(region_name=REGION)
    gaps.install(s)
    public_parameters.install(s)
    service_quotas.install(s)
    return s


@pytest.fixture
def instance_profile(session) -> str:
    """The instance profile the test configs name, in moto's IAM (RunInstances checks that it exists),
    whose role may read every deployment's secret (launch checks that it may read its own)."""
    iam = session.client("iam")
    iam.create_role(RoleName=INSTANCE_PROFILE, AssumeRolePolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                                                "Action": "sts:AssumeRole"}]}))
    iam.put_role_policy(RoleName=INSTANCE_PROFILE, PolicyName="secrets", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "ssm:GetParameter",
                                                "Resource": "arn:aws:ssm:*:*:parameter/*"}]}))
    iam.create_instance_profile(InstanceProfileName=INSTANCE_PROFILE)
    iam.add_role_to_instance_profile(InstanceProfileName=INSTANCE_PROFILE, RoleName=INSTANCE_PROFILE)
    return INSTANCE_PROFILE


@pytest.fixture
def ec2(session):
    """A plain client for arranging and checking moto's state (bypasses nothing: same server)."""
    return session.client("ec2")


@pytest.fixture
def network(ec2) -> dict[str, str]:
    """A private subnet whose default route is a NAT gateway in a public subnet, as a real EFA
    deployment needs (its instances get no public IP)."""
    vpc = ec2.create_vpc(CidrBlock="10.20.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.20.1.0/24", AvailabilityZone=f"{REGION}a")["Subnet"]
    public = ec2.create_subnet(VpcId=vpc, CidrBlock="10.20.2.0/24", AvailabilityZone=f"{REGION}a")["Subnet"]
    igw = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=igw, VpcId=vpc)
    nat = ec2.create_nat_gateway(SubnetId=public["SubnetId"],
                                 AllocationId=ec2.allocate_address(Domain="vpc")["AllocationId"])["NatGateway"]
    table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat["NatGatewayId"])
    ec2.associate_route_table(RouteTableId=table, SubnetId=subnet["SubnetId"])
    return {"vpc_id": vpc, "subnet_id": subnet["SubnetId"], "zone": subnet["AvailabilityZone"], "route_table": table,
            "nat": nat["NatGatewayId"], "igw": igw}


def subnet_in(ec2, network: dict[str, str], zone: str, cidr: str = "10.20.4.0/24") -> str:
    """Another private subnet of ``network``, in ``zone``, routed through its NAT gateway (moto carries
    AWS's offerings: us-east-2a offers trn2.48xlarge and p5en.48xlarge, only us-east-2c trn1.32xlarge)."""
    subnet = ec2.create_subnet(VpcId=network["vpc_id"], CidrBlock=cidr, AvailabilityZone=zone)["Subnet"]["SubnetId"]
    ec2.associate_route_table(RouteTableId=network["route_table"], SubnetId=subnet)
    return subnet


def register_image(ec2, name: str, platform: str | None = None) -> str:
    """An AMI in moto (registered, no builder instance), tagged like ami/neuron-disagg.pkr.hcl tags ours."""
    image = ec2.register_image(Name=name, RootDeviceName="/dev/sda1", Architecture="x86_64",
                               BlockDeviceMappings=[{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 64}}])["ImageId"]
    if platform:
        ec2.create_tags(Resources=[image], Tags=[{"Key": "neuron-disagg:platform", "Value": platform}])
    return image


@pytest.fixture
def baked_ami(ec2) -> str:
    return register_image(ec2, "neuron-disagg-neuron-test", "neuron")


@pytest.fixture
def ssm(session):
    """A plain SSM client for checking moto's state (the secret's SecureString)."""
    return session.client("ssm")


@pytest.fixture
def cloud(session, instance_profile) -> Cloud:
    return Cloud(session, log=io.StringIO())


def write_config(tmp_path: Path, network: dict[str, str] | None = None, **values: Any) -> Path:
    data: dict[str, Any] = {
        "name": "t1", "region": REGION, "model": "Qwen/Qwen3-32B",
        "hosts": {"neuron": {"tensor_parallel_size": 8}, "cuda": {"tensor_parallel_size": 8}},
        "prefill": {"instance_type": "trn2.48xlarge", "count": 1},
        "decode": {"instance_type": "trn2.48xlarge", "count": 1},
        "key_name": "my-key", "iam_instance_profile": INSTANCE_PROFILE,
        "neuron_disagg": {"mode": "push", "lease_s": 30},
    }
    if network:
        data["subnet_id"] = network["subnet_id"]
    data.update(values)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def deny(cloud, monkeypatch, service: str) -> None:
    """Every call ``cloud`` makes to ``service`` is refused, as credentials without its permissions would be."""
    from neuron_disagg.deploy.errors import PermissionDenied

    call = cloud.call

    def denied(svc, operation, **params):
        if svc == service:
            raise PermissionDenied(f"the credentials may not call {operation}")
        return call(svc, operation, **params)

    monkeypatch.setattr(cloud, "call", denied)
