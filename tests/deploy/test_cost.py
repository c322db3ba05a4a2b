"""What a launch costs is said, and confirmed, before anything bills."""

from __future__ import annotations

import json

import pytest

from neuron_disagg.deploy import cost
from neuron_disagg.deploy.cloud import DryRunCloud
from neuron_disagg.deploy.launch import launch

from .test_launch import deployment, instances_of

#: One product of GetProducts' PriceList, shaped as AWS documents it (trimmed to what is read).
PRODUCT = {"product": {"attributes": {"instanceType": "trn2.48xlarge", "regionCode": "us-east-2"}},
           "terms": {"OnDemand": {"X.JRTCKXETXF": {"priceDimensions": {"X.JRTCKXETXF.6YS6EN2CT7": {
               "unit": "Hrs", "pricePerUnit": {"USD": "44.7040000000"}, "description": "$44.704 per On Demand"}}}}}}


def test_the_price_list_answer_is_read_and_preferred_to_the_table():
    assert cost.on_demand_usd([json.dumps(PRODUCT)]) == pytest.approx(44.704)
    assert cost.on_demand_usd([]) is None

    class Answering:
        def call(self, service, operation, **params):
            assert (service, operation) == ("pricing", "GetProducts")
            assert {"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-east-2"} in params["Filters"]
            return {"PriceList": [json.dumps(PRODUCT)]}

    assert cost.price(Answering(), "trn2.48xlarge", "us-east-2") == (pytest.approx(44.704),
                                                                      "AWS Price List API, us-east-2")
    usd, source = cost.price(DryRunCloud("us-east-2"), "trn2.48xlarge", "us-east-2")
    assert usd == cost.ON_DEMAND_USD_PER_HOUR["trn2.48xlarge"][0] and source.startswith("our table of 2026-12")
    assert cost.price(DryRunCloud("us-east-2"), "trn9.huge", "us-east-2")[0] is None


def test_the_summary_counts_types_and_says_what_is_prepaid_or_unknown():
    lines = cost.estimate(DryRunCloud("us-east-2"), "us-east-2",
                          [("trn2.48xlarge", 2, False), ("trn2.48xlarge", 1, False), ("p5en.48xlarge", 4, True),
                           ("trn9.huge", 1, False)])
    text = cost.summary("d", "us-east-2", lines, max_hours=None)
    assert "  3 x trn2.48xlarge: $35.40/h each" in text
    assert "  4 x p5en.48xlarge: price not known (Capacity Block: prepaid at purchase, plus its OS fee)" in text
    assert "plus what is not known" in text and "until `neuron-disagg teardown` (or set max_hours" in text


def test_confirmation_asks_and_only_yes_goes_on():
    cost.confirm("bill", yes=True, ask=None)
    cost.confirm("bill", yes=False, ask=lambda prompt: "yes\n")
    for answer in ("", "no\n", "sure\n"):
        with pytest.raises(cost.LaunchNotConfirmed, match="nothing was created"):
            cost.confirm("bill", yes=False, ask=lambda prompt, answer=answer: answer)
    with pytest.raises(cost.LaunchNotConfirmed, match="pass --yes"):
        cost.confirm("bill", yes=False, ask=None)


def test_launch_asks_after_its_checks_and_before_its_first_write(cloud, network, baked_ami, gaps, ec2, tmp_path):
    asked = []

    def refuse(bill):
        asked.append((bill, list(gaps.placement_groups), len(gaps.run_instances_wire)))
        raise cost.LaunchNotConfirmed("no")

    with pytest.raises(cost.LaunchNotConfirmed):
        launch(cloud, deployment(tmp_path, network), confirm=refuse)
    ((bill, groups, runs),) = asked
    assert "2 x trn2.48xlarge" in bill and groups == [] and runs == 0
    assert instances_of(ec2) == []
    launch(cloud, deployment(tmp_path, network), confirm=lambda bill: None)
    assert len(instances_of(ec2)) == 2


def test_a_capacity_block_is_prepaid_an_on_demand_reservation_is_not(cloud, network, baked_ami, gaps, tmp_path):
    gaps.reserve("cr-0abc", "trn2.48xlarge", network["zone"], capacity_block=True)
    gaps.reserve("cr-0def", "trn2.48xlarge", network["zone"], capacity_block=False)
    bills = []
    launch(cloud, deployment(tmp_path, network, prefill={"instance_type": "trn2.48xlarge", "capacity_block_id": "cr-0abc"},
                             decode={"instance_type": "trn2.48xlarge", "capacity_block_id": "cr-0def"}),
           confirm=bills.append)
    assert "1 x trn2.48xlarge: price not known (Capacity Block: prepaid" in bills[0]
    assert "1 x trn2.48xlarge: $35.40/h each" in bills[0]
