"""One owner of every timeout's default (protocol/timeouts.py): each side's timeouts, the config and
the params signer take theirs from it, and nobody builds timeouts from a row of bare numbers."""

from dataclasses import fields

import pytest

from neuron_disagg.config import Config
from neuron_disagg.kv_params import ParamsSigner
from neuron_disagg.protocol import ConsumerTimeouts, LenderTimeouts, ProducerTimeouts, ReaderTimeouts
from neuron_disagg.protocol.timeouts import DEFAULTS, Timeouts

SIDES = [ProducerTimeouts, ConsumerTimeouts, LenderTimeouts, ReaderTimeouts]
SIDE_OF = {ProducerTimeouts: Config.producer_timeouts, ConsumerTimeouts: Config.consumer_timeouts,
           LenderTimeouts: Config.lender_timeouts, ReaderTimeouts: Config.reader_timeouts}


@pytest.mark.parametrize("side", SIDES, ids=lambda s: s.__name__)
def test_each_sides_timeouts_default_to_the_one_owners(side):
    assert side() == DEFAULTS.for_side(side)
    assert {f.name for f in fields(side)} <= {f.name for f in fields(Timeouts)}


def test_the_configs_timeout_defaults_are_the_one_owners():
    assert Config().timeouts() == DEFAULTS


def test_the_params_signer_defaults_to_the_one_owners_ttl_and_skew():
    signer = ParamsSigner(b"timeouts-tests-deployment-secret-01")
    assert (signer.ttl_s, signer.skew_s) == (DEFAULTS.params_ttl_s, DEFAULTS.clock_skew_allowance_s)


@pytest.mark.parametrize("side", SIDES, ids=lambda s: s.__name__)
def test_a_config_hands_each_side_every_knob_of_its_own_by_name(side):
    # Distinct values per knob, so a knob handed to the wrong field shows.
    values = {f.name: 1.0 + i for i, f in enumerate(fields(Timeouts))}
    values["lease_s"] = 2 * values["heartbeat_interval_s"] + 1  # heartbeats must fit in the lease
    config = Config(**values)
    got = SIDE_OF[side](config)
    assert {f.name: getattr(got, f.name) for f in fields(side)} == {f.name: values[f.name] for f in fields(side)}


@pytest.mark.parametrize("side", [Timeouts, *SIDES], ids=lambda s: s.__name__)
def test_timeouts_refuse_a_row_of_bare_numbers(side):
    with pytest.raises(TypeError):
        side(30.0, 30.0)
