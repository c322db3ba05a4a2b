"""Capacity reservations an instance group launches into, checked before anything is created.

``capacity_block_id`` may name a Capacity Block or an On-Demand Capacity Reservation (both are
``cr-...``); AWS launches them differently (a Capacity Block needs ``MarketType=capacity-block``, an
ODCR must not have it), and a reservation of another type, zone or instance type, one not started,
or one with too few free instances fails at RunInstances with a generic or misleading error. So each
is described first, and every mismatch is said in the terms of the fix. A reservation made inside a
cluster placement group is launched into that group too; a Capacity Block whose end comes before
the instances would have warmed up and served a while is refused, with its end time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from .cloud import Cloud
from .errors import AwsCallFailed, ReservationUnusable

CAPACITY_BLOCK = "capacity-block"


#: A Capacity Block's instances begin to terminate this long before its end time (AWS's documented lead).
BLOCK_TERMINATION_LEAD = timedelta(minutes=30)
#: From boot to serving: the model's download and load, and on Trainium its compilation (tens of minutes).
WARM_UP = {"neuron": timedelta(minutes=60), "cuda": timedelta(minutes=20)}
#: Serving time a launch into a Capacity Block must still have once warmed up, or it is refused.
MIN_SERVING = timedelta(minutes=30)


@dataclass(frozen=True)
class Reservation:
    reservation_id: str
    capacity_block: bool  # False: an On-Demand Capacity Reservation
    placement_group: str | None = None  # the cluster placement group the reservation was made in, if any
    end: datetime | None = None  # None: no end (an On-Demand reservation without one)

    def run_instances_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"CapacityReservationSpecification": {
            "CapacityReservationTarget": {"CapacityReservationId": self.reservation_id}}}
        if self.capacity_block:
            params["InstanceMarketOptions"] = {"MarketType": CAPACITY_BLOCK}
        if self.placement_group:  # AWS's launch steps for a reservation in a group name both
            params["Placement"] = {"GroupName": self.placement_group}
        return params


def check(cloud: Cloud, reservation_id: str, instance_type: str, zone: str, count: int, *,
          platform: str = "neuron", now: datetime | None = None) -> Reservation:
    """The reservation, if ``count`` instances of ``instance_type`` can launch into it in ``zone`` and,
    for a Capacity Block, still serve a while after warming up on ``platform``."""
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
    end = _when(r.get("EndDate"))
    if capacity_block and state == "active" and end is not None:
        now = now or datetime.now(timezone.utc)
        ready = now + WARM_UP.get(platform, WARM_UP["neuron"])
        stops = end - BLOCK_TERMINATION_LEAD
        if stops - ready < MIN_SERVING:
            problems.append(f"it ends at {end.isoformat(timespec='minutes')} and its instances are terminated from "
                            f"{stops.isoformat(timespec='minutes')}, but instances launched now serve only from about "
                            f"{ready.isoformat(timespec='minutes')} (about {_minutes(WARM_UP.get(platform, WARM_UP['neuron']))}"
                            f" of download, load{' and compilation' if platform == 'neuron' else ''}): less than "
                            f"{_minutes(MIN_SERVING)} of serving. Use a later or longer block")
    if problems:
        raise ReservationUnusable(f"cannot launch {count} x {instance_type} into {kind} {reservation_id}: "
                                  + "; ".join(problems))
    arn = r.get("PlacementGroupArn") or ""
    group = arn.rsplit("/", 1)[-1] if arn else None
    if capacity_block and end is not None:
        cloud.note(f"Capacity Block {reservation_id} ends at {end.isoformat(timespec='minutes')}; its instances are "
                   f"terminated from {(end - BLOCK_TERMINATION_LEAD).isoformat(timespec='minutes')}")
    return Reservation(reservation_id, capacity_block, group, end)


def _when(value: Any) -> datetime | None:
    """botocore gives a datetime; a stand-in may give ISO text."""
    if value is None or value == "":
        return None
    when = value if isinstance(value, datetime) else datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _minutes(span: timedelta) -> str:
    return f"{int(span.total_seconds() // 60)} min"
