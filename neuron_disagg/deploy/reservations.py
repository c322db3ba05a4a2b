"""Capacity reservations an instance group launches into, checked before anything is created.

``capacity_block_id`` may name a Capacity Block or an On-Demand Capacity Reservation (both are
``cr-...``); AWS launches them differently (a Capacity Block needs ``MarketType=capacity-block``, an
ODCR must not have it), and a reservation of another type, zone or instance type, one not started,
or one with too few free instances fails at RunInstances with a generic or misleading error. So each
is described first, and every mismatch is said in the terms of the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cloud import Cloud
from .errors import AwsCallFailed, ReservationUnusable

CAPACITY_BLOCK = "capacity-block"


@dataclass(frozen=True)
class Reservation:
    reservation_id: str
    capacity_block: bool  # False: an On-Demand Capacity Reservation

    def run_instances_params(self) -> dict[str, Any]:
        target = {"CapacityReservationSpecification": {
            "CapacityReservationTarget": {"CapacityReservationId": self.reservation_id}}}
        return {**target, "InstanceMarketOptions": {"MarketType": CAPACITY_BLOCK}} if self.capacity_block else target


def check(cloud: Cloud, reservation_id: str, instance_type: str, zone: str, count: int) -> Reservation:
    """The reservation, if ``count`` instances of ``instance_type`` can launch into it in ``zone``."""
    try:
        response = cloud.call("ec2", "DescribeCapacityReservations", CapacityReservationIds=[reservation_id])
    except AwsCallFailed as exc:
        if "NotFound" in exc.code or "Malformed" in exc.code:
            raise ReservationUnusable(f"capacity reservation {reservation_id} does not exist in {cloud.region} "
                                      "(or belongs to another account); check the id and the region") from None
        raise
    if response is None:  # a dry run: assume it is what the config says, a Capacity Block
        return Reservation(reservation_id, capacity_block=True)
    found = response.get("CapacityReservations", [])
    if not found:
        raise ReservationUnusable(f"capacity reservation {reservation_id} does not exist in {cloud.region}")
    r = found[0]
    capacity_block = r.get("ReservationType") == CAPACITY_BLOCK
    kind = "Capacity Block" if capacity_block else "On-Demand Capacity Reservation"
    problems = []
    if r.get("InstanceType") != instance_type:
        problems.append(f"it reserves {r.get('InstanceType')}, not {instance_type}")
    if r.get("AvailabilityZone") != zone:
        problems.append(f"it is in {r.get('AvailabilityZone')} but the subnet is in {zone}: use a subnet in "
                        f"{r.get('AvailabilityZone')} (--subnet)")
    state = r.get("State")
    if state == "scheduled":
        problems.append(f"it starts at {r.get('StartDate')}: launch then")
    elif state != "active":
        problems.append(f"its state is {state!r}, not 'active'")
    free = r.get("AvailableInstanceCount", 0)
    if state == "active" and free < count:
        problems.append(f"{free} of its {r.get('TotalInstanceCount', '?')} instances are free, {count} needed")
    if problems:
        raise ReservationUnusable(f"cannot launch {count} x {instance_type} into {kind} {reservation_id}: "
                                  + "; ".join(problems))
    return Reservation(reservation_id, capacity_block)
