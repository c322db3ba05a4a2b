"""A reservation made in a cluster placement group is launched into it, and a
Capacity Block too near its end is refused with its end time. DescribeCapacityReservations is
answered by ``MotoGaps.reserve`` (moto has no Capacity Blocks); RunInstances goes to moto."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from neuron_disagg.deploy import reservations
from neuron_disagg.deploy.errors import ReservationUnusable
from neuron_disagg.deploy.launch import launch

from .test_launch import deployment, instances_of

BLOCK = {"instance_type": "trn2.48xlarge", "capacity_block_id": "cr-0abc"}


@pytest.mark.parametrize("capacity_block", [True, False])
def test_a_reservation_made_in_a_placement_group_launches_into_it(cloud, network, baked_ami, gaps, ec2, tmp_path,
                                                                 capacity_block):
    gaps.reserve("cr-0abc", "trn2.48xlarge", network["zone"], capacity_block=capacity_block,
                 placement_group="team-cluster-1")
    launch(cloud, deployment(tmp_path, network, prefill=BLOCK, decode=BLOCK))
    (wire,) = gaps.run_instances_wire
    assert wire["Placement.GroupName"] == "team-cluster-1"
    assert wire["CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId"] == "cr-0abc"
    assert gaps.placement_groups == {}  # none of ours: the reservation's group is the one
    assert len(instances_of(ec2)) == 2


@pytest.mark.parametrize("instance_type, hours_left, refused", [
    ("trn2.48xlarge", 1.5, True),    # 60 min to compile, then 30 min before the end it goes: nothing left
    ("trn2.48xlarge", 2.5, False),
    ("p5en.48xlarge", 1.5, False),   # no compilation: 20 min warm-up
    ("p5en.48xlarge", 1.0, True),
])
def test_a_capacity_block_near_its_end_is_refused_with_its_end_time(cloud, network, gaps, ec2, tmp_path,
                                                                   instance_type, hours_left, refused):
    from .conftest import register_image
    register_image(ec2, "baked", "neuron" if instance_type.startswith("trn") else "cuda")
    gaps.reserve("cr-0abc", instance_type, network["zone"], hours_left=hours_left)
    group = {"instance_type": instance_type, "capacity_block_id": "cr-0abc"}
    if refused:
        with pytest.raises(ReservationUnusable, match=r"it ends at 20\d\d-.* less than 30 min of serving"):
            launch(cloud, deployment(tmp_path, network, prefill=group, decode=group))
        assert gaps.run_instances_wire == []
    else:
        launch(cloud, deployment(tmp_path, network, prefill=group, decode=group))
        assert "Capacity Block cr-0abc ends at" in cloud.log.getvalue()
        assert len(gaps.run_instances_wire) == 1


def test_the_end_time_check_counts_from_now_and_only_for_blocks(cloud):
    now = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc)

    class Answer:
        region = "us-east-2"

        def __init__(self, **entry):
            self.entry = {"InstanceType": "trn2.48xlarge", "AvailabilityZone": "z", "State": "active",
                          "AvailableInstanceCount": 2, "ReservationType": "capacity-block", **entry}

        def call(self, service, operation, **params):
            return {"CapacityReservations": [self.entry]}

        def note(self, text):
            pass

    ends = now + timedelta(minutes=119)  # 60 warm-up + 30 lead + 30 serving = 120 needed
    with pytest.raises(ReservationUnusable, match="it ends at 2026-12-03T13:59"):
        reservations.check(Answer(EndDate=ends), "cr-1", "trn2.48xlarge", "z", 2, now=now)
    assert reservations.check(Answer(EndDate=ends + timedelta(minutes=1)), "cr-1", "trn2.48xlarge", "z", 2,
                              now=now).end == ends + timedelta(minutes=1)
    odcr = reservations.check(Answer(EndDate=ends, ReservationType="default"), "cr-1", "trn2.48xlarge", "z", 2, now=now)
    assert odcr.capacity_block is False  # an On-Demand reservation's end ends only the reservation
