"""Shared fixtures: the shipped profile, and a 'bare' one with every delay outside P's engine loop
set to zero so queueing results can be compared with closed forms."""

from __future__ import annotations

import pytest

from neuron_disagg.sim import get_profile


@pytest.fixture
def p5en():
    return get_profile("p5en")


@pytest.fixture
def bare(p5en):
    return p5en.replace(router_hop_s=0.0, frontend_s_per_token=0.0, handoff_s=0.0)
