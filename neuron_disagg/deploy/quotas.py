"""The account's On-Demand vCPU quotas, checked before launch creates anything.

Each trn2.48xlarge and p5en.48xlarge counts 192 vCPUs against its family's quota, and a new account
usually has 0 for the Trn and P families. EC2 says so only at RunInstances (``VcpuLimitExceeded``),
after the placement group, the security group and the secret exist. So launch asks Service Quotas
first (``servicequotas:GetServiceQuota``, the applied value, else ``GetAWSDefaultServiceQuota``),
counts what already runs in the family (``DescribeInstances``), and refuses a launch that would not
fit, naming the quota, its code and the shortfall. Instances in a capacity reservation are left out:
a Capacity Block needs no On-Demand quota, and an On-Demand Capacity Reservation already holds its
capacity. Without permission to read the quota, launch warns and goes on.

Quota codes (EC2's vCPU quotas by family; Service Quotas names each): L-2C3B7624 "Running On-Demand
Trn instances", L-417A185B "Running On-Demand P instances", L-1945791B "Running On-Demand Inf
instances". They were read from public code and listings of ListServiceQuotas output, not from an
AWS documentation page; the quota's name that AWS answers with is what the message shows.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from .cloud import Cloud
from .errors import AwsCallFailed, DeployError, QuotaExceeded
from .instance_types import InstanceTypeInfo

SERVICE_CODE = "ec2"


@dataclass(frozen=True)
class Family:
    """One On-Demand vCPU quota and the instance types it counts."""

    name: str  # the quota's name in Service Quotas
    code: str
    prefixes: tuple[str, ...]  # instance type families it counts, e.g. ("trn",) for trn1 and trn2

    def counts(self, instance_type: str) -> bool:
        family = instance_type.split(".", 1)[0]
        return any(family.startswith(prefix) and family[len(prefix):len(prefix) + 1].isdigit()
                   for prefix in self.prefixes)


FAMILIES = (
    Family("Running On-Demand Trn instances", "L-2C3B7624", ("trn",)),
    Family("Running On-Demand P instances", "L-417A185B", ("p",)),
    Family("Running On-Demand Inf instances", "L-1945791B", ("inf",)),
)


def family_of(instance_type: str) -> Family | None:
    return next((f for f in FAMILIES if f.counts(instance_type)), None)


def quota_vcpus(cloud: Cloud, family: Family) -> tuple[float | None, str]:
    """(the quota's value in vCPUs, its name as AWS gives it): the applied value if the account has one,
    else AWS's default. (None, name) in a dry run."""
    try:
        response = cloud.call("service-quotas", "GetServiceQuota", ServiceCode=SERVICE_CODE, QuotaCode=family.code)
    except AwsCallFailed as exc:
        if exc.code != "NoSuchResourceException":
            raise
        response = cloud.call("service-quotas", "GetAWSDefaultServiceQuota", ServiceCode=SERVICE_CODE,
                              QuotaCode=family.code)
    if response is None:
        return None, family.name
    quota = response.get("Quota", {})
    return float(quota.get("Value", 0.0)), quota.get("QuotaName") or family.name


def running_vcpus(cloud: Cloud, family: Family, vcpus_of: dict[str, int]) -> int:
    """vCPUs of the family's On-Demand instances now pending or running in the region (the family is
    told by the type's name here, as EC2's quota does, rather than by a wildcard filter). ``vcpus_of``:
    the vCPUs of types already described; others are asked for."""
    filters = [{"Name": "instance-state-name", "Values": ["pending", "running"]}]
    counted: list[dict[str, Any]] = []
    token = None
    while True:
        page = cloud.call("ec2", "DescribeInstances", Filters=filters, **({"NextToken": token} if token else {}))
        if page is None:
            return 0
        counted += [i for r in page.get("Reservations", []) for i in r.get("Instances", [])
                    if family.counts(i.get("InstanceType", ""))
                    and i.get("InstanceLifecycle") not in ("spot", "capacity-block")]  # their own quotas, or none
        token = page.get("NextToken")
        if not token:
            break
    known = dict(vcpus_of)
    unknown = sorted({i["InstanceType"] for i in counted if not _cpu_options(i)} - set(known))
    for start in range(0, len(unknown), 100):  # DescribeInstanceTypes takes up to 100 names
        described = cloud.call("ec2", "DescribeInstanceTypes", InstanceTypes=unknown[start:start + 100]) or {}
        known.update({t["InstanceType"]: t.get("VCpuInfo", {}).get("DefaultVCpus", 0)
                      for t in described.get("InstanceTypes", [])})
    return sum(_cpu_options(i) or known.get(i["InstanceType"], 0) for i in counted)


def _cpu_options(instance: dict[str, Any]) -> int:
    """The instance's own vCPU count where EC2 gives it (its CPU options), else 0."""
    cpu = instance.get("CpuOptions") or {}
    return int(cpu.get("CoreCount", 0)) * int(cpu.get("ThreadsPerCore", 0))


def check(cloud: Cloud, launches: list[tuple[str, int, bool]], types: dict[str, InstanceTypeInfo]) -> None:
    """``launches``: (instance type, count, in a capacity reservation) of what launch will start.
    Refuses, naming quota, code and shortfall, a launch the account's On-Demand vCPU quota cannot take."""
    needed: dict[Family, list[tuple[str, int, int]]] = defaultdict(list)  # family -> (type, count, vCPUs each)
    for instance_type, count, reserved in launches:
        family = family_of(instance_type)
        info = types.get(instance_type)
        if reserved or family is None or info is None:
            continue
        if info.vcpus is None and not cloud.dry_run:  # a dry run still shows the quota it would read
            cloud.note(f"WARNING: the vCPUs of {instance_type} are not known: its quota is not checked")
            continue
        needed[family].append((instance_type, count, info.vcpus or 0))
    vcpus_of = {name: info.vcpus for name, info in types.items() if info.vcpus}
    for family, wanted in needed.items():
        try:
            limit, name = quota_vcpus(cloud, family)
            in_use = running_vcpus(cloud, family, vcpus_of) if limit is not None else 0
        except DeployError as exc:  # no permission to read quotas: EC2 still refuses at RunInstances
            cloud.note(f"WARNING: cannot read the quota {family.name!r} ({family.code}) ({exc}); if it is too "
                       "small, RunInstances fails with VcpuLimitExceeded")
            continue
        if limit is None:  # a dry run
            continue
        need = sum(count * each for _, count, each in wanted)
        if in_use + need <= limit:
            continue
        what = " and ".join(f"{count} x {instance_type} ({each} vCPUs each)" for instance_type, count, each in wanted)
        short = in_use + need - int(limit)
        raise QuotaExceeded(
            f"the account's quota {name!r} ({family.code}) in {cloud.region} allows {limit:g} vCPUs; {in_use} are in "
            f"use and this launch needs {need} more, for {what}: {short} short. Nothing was created. Request at "
            f"least {in_use + need} in Service Quotas (`aws service-quotas request-service-quota-increase "
            f"--service-code ec2 --quota-code {family.code} --desired-value {in_use + need} --region "
            f"{cloud.region}`; approval can take days), or use a Capacity Block (--capacity-block), which needs "
            "no On-Demand quota")
