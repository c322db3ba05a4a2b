"""What a launch will cost, said before anything bills, and the confirmation it waits for.

A forgotten trn2 1P1D runs about $1.7k a day On-Demand, so a live launch first prints count, type,
region and hourly price and waits for ``--yes`` or a typed "yes". The price comes from AWS's Price
List API where the credentials may read it (``pricing:GetProducts``); otherwise from the dated table
below, said as such. Instances in a Capacity Block are prepaid (the reservation fee was charged at
purchase), so they are listed as such, not priced again.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from collections.abc import Callable

from .cloud import Cloud
from .errors import DeployError

#: On-Demand Linux USD per instance-hour, with where each figure came from. Used only when the Price
#: List API cannot be read; check https://aws.amazon.com/ec2/pricing/on-demand/ before trusting it.
TABLE_AS_OF = "2026-12"
ON_DEMAND_USD_PER_HOUR: dict[str, tuple[float, str]] = {
    "p5en.48xlarge": (63.296, "us-east-1/-2 and us-west-2 On-Demand as listed by dstack's AWS offers, 2026-08"),
    "p5.48xlarge": (55.04, "us-east-1 On-Demand, data-receipts GPU pricing, 2026-11"),
    "trn2.48xlarge": (35.4, "estimate: about $1.7k a day for a 1P1D pair (our deployment audit); not "
                            "read from AWS's page"),
    "trn1.32xlarge": (21.50, "us-east-1 On-Demand"),
}
PRICING_REGION = "us-east-1"  # one of the Price List API's endpoints; it answers for every region


class LaunchNotConfirmed(DeployError):
    """A live launch was not confirmed: nothing was created."""

    exit_code = 5


@dataclass
class Line:
    instance_type: str
    count: int
    usd_per_hour: float | None  # None: unknown, or prepaid in a Capacity Block
    source: str


def price(cloud: Cloud, instance_type: str, region: str) -> tuple[float | None, str]:
    """(USD per instance-hour On-Demand, where the figure came from)."""
    try:
        response = cloud.call("pricing", "GetProducts", ServiceCode="AmazonEC2", MaxResults=10, Filters=[
            {"Type": "TERM_MATCH", "Field": field, "Value": value} for field, value in (
                ("instanceType", instance_type), ("regionCode", region), ("operatingSystem", "Linux"),
                ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used"))])
        found = on_demand_usd(response.get("PriceList", []) if response else [])
        if found is not None:
            return found, f"AWS Price List API, {region}"
    except Exception:  # noqa: BLE001 - advisory: no permission, no endpoint, an emulator without it
        pass
    if instance_type in ON_DEMAND_USD_PER_HOUR:
        usd, source = ON_DEMAND_USD_PER_HOUR[instance_type]
        return usd, f"our table of {TABLE_AS_OF} ({source})"
    return None, "unknown: the Price List API could not be read and our table has no such type"


def on_demand_usd(price_list: list[str]) -> float | None:
    """The hourly On-Demand USD price in GetProducts' PriceList (JSON documents, one per product)."""
    for document in price_list:
        product = json.loads(document) if isinstance(document, str) else document
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                usd = float(dimension.get("pricePerUnit", {}).get("USD", "0") or 0)
                if dimension.get("unit") == "Hrs" and usd > 0:
                    return usd
    return None


def estimate(cloud: Cloud, region: str, groups: list[tuple[str, int, bool]]) -> list[Line]:
    """``groups``: (instance type, count, in a Capacity Block) of what the launch starts."""
    counts: Counter[tuple[str, bool]] = Counter()
    for instance_type, count, prepaid in groups:
        counts[(instance_type, prepaid)] += count
    lines = []
    for (instance_type, prepaid), count in sorted(counts.items()):
        if prepaid:
            lines.append(Line(instance_type, count, None, "Capacity Block: prepaid at purchase, plus its OS fee"))
        else:
            lines.append(Line(instance_type, count, *price(cloud, instance_type, region)))
    return lines


def summary(name: str, region: str, lines: list[Line], max_hours: float | None) -> str:
    rows = []
    total = 0.0
    for line in lines:
        each = f"${line.usd_per_hour:,.2f}/h each" if line.usd_per_hour is not None else "price not known"
        rows.append(f"  {line.count} x {line.instance_type}: {each} ({line.source})")
        total += (line.usd_per_hour or 0.0) * line.count
    known = all(line.usd_per_hour is not None or line.source.startswith("Capacity Block") for line in lines)
    bill = f"about ${total:,.2f} an hour, ${total * 24:,.0f} a day" + ("" if known else " plus what is not known")
    until = (f"each instance powers off and terminates {max_hours:g} h after its first boot, reboots included "
             f"(max_hours): at most about ${total * max_hours:,.0f}" if max_hours else
             "max_hours is 0: they run until `neuron-disagg teardown` (or set max_hours in the deployment config)")
    return (f"launch {name} in {region}:\n" + "\n".join(rows) + f"\n  On-Demand: {bill}; billed from the moment "
            f"they start; {until}.")


def confirm(text: str, yes: bool, ask: Callable[[str], str] | None) -> None:
    """Goes on only with ``yes`` or a typed "yes" (``ask`` is None when no one can answer)."""
    if yes:
        print(text, file=sys.stderr, flush=True)
        return
    if ask is None:
        raise LaunchNotConfirmed(f"{text}\nnot launched: no terminal to confirm at; pass --yes to launch")
    if ask(f"{text}\nlaunch? type yes: ").strip().lower() not in ("y", "yes"):
        raise LaunchNotConfirmed("not launched: not confirmed; nothing was created")
