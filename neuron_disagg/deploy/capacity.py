"""Capacity Block offerings: reserved accelerator capacity for a fixed window, the usual way to get
trn2 or p5en when on-demand capacity is short (the no-capacity error points here).

Listing is all this does; purchasing spends money, so it stays a deliberate step the user takes
(`aws ec2 purchase-capacity-block --capacity-block-offering-id ...`) before passing the reservation id.
"""

from __future__ import annotations

from typing import Any, TextIO

from .cloud import Cloud


def offerings(cloud: Cloud, instance_type: str, count: int, hours: int) -> list[dict[str, Any]]:
    response = cloud.call("ec2", "DescribeCapacityBlockOfferings", InstanceType=instance_type,
                          InstanceCount=count, CapacityDurationHours=hours)
    if response is None:
        return []
    return sorted(response.get("CapacityBlockOfferings", []), key=lambda o: str(o.get("StartDate", "")))


def print_offerings(rows: list[dict[str, Any]], instance_type: str, count: int, hours: int, out: TextIO) -> None:
    if not rows:
        print(f"no Capacity Block offerings for {count} x {instance_type} for {hours} h; try another duration, "
              "count or region", file=out)
        return
    print(f"Capacity Block offerings for {count} x {instance_type}, {hours} h:", file=out)
    for o in rows:
        print(f"  {o.get('CapacityBlockOfferingId', '?')}  {o.get('AvailabilityZone', '?')}  "
              f"{o.get('StartDate', '?')} -> {o.get('EndDate', '?')}  {o.get('UpfrontFee', '?')} "
              f"{o.get('CurrencyCode', '')}", file=out)
    print("buy one with `aws ec2 purchase-capacity-block --capacity-block-offering-id ID --instance-platform "
          "Linux/UNIX`, then launch with --capacity-block cr-... and a subnet in that offering's zone", file=out)
