"""What an instance type offers for disaggregated serving, read from DescribeInstanceTypes, and the
network interface layout that follows from it.

Why read it instead of a table: the number of network cards and which of them take EFA differ per
type (16 on trn2.48xlarge and p5en.48xlarge, 8 on trn1.32xlarge) and AWS adds types faster than a
table here would be updated. One EFA per card gives the NIXL LIBFABRIC backend every rail. The same
answer says how many accelerators a host has to cut into vLLM instances (``sizing.py``) and how
many vCPUs each instance counts against the account's quota (``quotas.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .cloud import Cloud, placeholder
from .errors import UnsupportedInstanceType

Platform = Literal["neuron", "cuda"]


@dataclass(frozen=True)
class InstanceTypeInfo:
    name: str
    platform: Platform | None  # None: neither Neuron devices nor NVIDIA GPUs
    efa_cards: tuple[int, ...]  # network card indices that accept an EFA interface, card 0 first
    known: bool = True  # False in a dry run: the layout is described, not computed
    accelerators: int | None = None  # what TP counts: logical NeuronCores at the default LNC, or GPUs
    vcpus: int | None = None  # what the account's On-Demand vCPU quota counts

    @classmethod
    def from_api(cls, item: dict[str, Any]) -> InstanceTypeInfo:
        name = item["InstanceType"]
        platform: Platform | None = None
        if item.get("NeuronInfo", {}).get("NeuronDevices"):
            platform = "neuron"
        elif any(gpu.get("Manufacturer") == "NVIDIA" for gpu in item.get("GpuInfo", {}).get("Gpus", [])):
            platform = "cuda"
        network = item.get("NetworkInfo", {})
        cards: tuple[int, ...] = ()
        if network.get("EfaSupported"):
            listed = network.get("NetworkCards")
            if listed:
                cards = tuple(sorted(card["NetworkCardIndex"] for card in listed
                                     if {"efa", "efa-only"} & set(card.get("InterfaceTypes", ["efa"]))))
            else:
                cards = tuple(range(network.get("MaximumNetworkCards", 1)))
            limit = network.get("EfaInfo", {}).get("MaximumEfaInterfaces")
            if limit is not None:
                cards = cards[:limit]
        return cls(name, platform, cards, accelerators=_accelerators(item),
                   vcpus=item.get("VCpuInfo", {}).get("DefaultVCpus"))

    @classmethod
    def unknown(cls, name: str) -> InstanceTypeInfo:
        """A dry run's: no AWS call, so the layout is described and the accelerators come from the table
        below where the type is in it (a real launch reads them from AWS)."""
        guess: Platform | None = "neuron" if name.startswith(("trn", "inf")) else "cuda"
        return cls(name, guess, (), known=False, accelerators=DRY_RUN_ACCELERATORS.get(name))

    def check_usable(self) -> None:
        if not self.known:
            return
        if not self.efa_cards or self.efa_cards[0] != 0:
            raise UnsupportedInstanceType(
                f"{self.name} has no EFA, so the KV cache cannot move between instances over RDMA; use an "
                "EFA instance type such as trn2.48xlarge, trn1.32xlarge or p5en.48xlarge")
        if self.platform is None:
            raise UnsupportedInstanceType(
                f"{self.name} has EFA but neither Neuron devices nor NVIDIA GPUs; use trn2/trn1 or p5en/p5")

    def network_interfaces(self, subnet_id: str, groups: list[str]) -> list[dict[str, Any]] | str:
        """Card 0 device 0 ``efa`` (it carries the IP address), every further card ``efa-only``."""
        if not self.known:
            return placeholder(f"one interface per network card of {self.name} from ec2:DescribeInstanceTypes "
                               "(NetworkInfo.NetworkCards, EfaInfo.MaximumEfaInterfaces): card 0 device 0 "
                               "InterfaceType efa, each further card device 0 InterfaceType efa-only, "
                               f"SubnetId {subnet_id}, Groups {groups}")
        return [{"NetworkCardIndex": card, "DeviceIndex": 0, "InterfaceType": "efa" if card == 0 else "efa-only",
                 "SubnetId": subnet_id, "Groups": list(groups), "DeleteOnTermination": True}
                for card in self.efa_cards]


#: Accelerators per host, for a dry run only (a launch reads DescribeInstanceTypes): trn2.48xlarge 16
#: Trainium2 chips of 8 NeuronCores, 64 logical cores at the default LNC=2; trn1.32xlarge 16 chips of 2
#: NeuronCore-v2 (LNC=1); p5en.48xlarge 8 H200; p5.48xlarge 8 H100.
DRY_RUN_ACCELERATORS = {"trn2.48xlarge": 64, "trn1.32xlarge": 32, "p5en.48xlarge": 8, "p5.48xlarge": 8}
#: NeuronCore versions whose default logical NeuronCore (LNC) spans two physical cores: v3 (Trainium2)
#: on. Neuron's own count for trn2.48xlarge is 64 logical cores, 128 physical.
LNC2_FROM_CORE_VERSION = 3


def _accelerators(item: dict[str, Any]) -> int | None:
    """What a vLLM instance's TP counts on this type: logical NeuronCores at the default LNC, or GPUs."""
    devices = item.get("NeuronInfo", {}).get("NeuronDevices", [])
    if devices:
        cores = 0
        for device in devices:
            core = device.get("CoreInfo", {})
            per_device = core.get("Count", 0) // (2 if core.get("Version", 0) >= LNC2_FROM_CORE_VERSION else 1)
            cores += device.get("Count", 0) * per_device
        return cores or None
    gpus = sum(gpu.get("Count", 0) for gpu in item.get("GpuInfo", {}).get("Gpus", []))
    return gpus or None


def describe(cloud: Cloud, names: list[str]) -> dict[str, InstanceTypeInfo]:
    """Each named type's info, failing on the first that does not exist or cannot serve."""
    found: dict[str, InstanceTypeInfo] = {}
    for name in sorted(set(names)):  # one call each, so an error names the one type at fault
        response = cloud.call("ec2", "DescribeInstanceTypes", InstanceTypes=[name])
        if response is None:
            found[name] = InstanceTypeInfo.unknown(name)
            continue
        items = [item for item in response.get("InstanceTypes", []) if item["InstanceType"] == name]
        if not items:
            raise UnsupportedInstanceType(f"{name} is not an instance type in {cloud.region}; check the spelling")
        found[name] = InstanceTypeInfo.from_api(items[0])
        found[name].check_usable()
    return found
