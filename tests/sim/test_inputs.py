"""Bad inputs fail early with messages that say what to pass instead; every profile parameter
names its source, and the trn2 projection says which of its figures are inferred."""

from __future__ import annotations

import json

import pytest

from neuron_disagg.sim import ProfileError, Scenario, ScenarioError, Sourced, get_profile
from neuron_disagg.sim.cli import main
from neuron_disagg.sim.params import KINDS


def test_unknown_mode_and_profile_name_the_choices():
    with pytest.raises(ScenarioError, match="push, pull, none"):
        Scenario("bogus", 1.0, 1024)
    with pytest.raises(ProfileError, match="p5en, trn2"):
        get_profile("h100")
    with pytest.raises(ScenarioError, match="rate"):
        from neuron_disagg.sim.workload import arrivals
        arrivals(0.0, 10, 0)


def test_sources_must_say_where_a_value_came_from():
    with pytest.raises(ProfileError, match="must start with one of"):
        Sourced(1.0, "s", "my guess")
    with pytest.raises(ProfileError, match="not a cost parameter"):
        get_profile("p5en").replace(warp_speed=1.0)


@pytest.mark.parametrize("name", ["p5en", "trn2"])
def test_every_parameter_has_a_source(name):
    for param, value in get_profile(name).sources():
        assert value.source.split(":", 1)[0] in KINDS and len(value.source) > 20, param


def test_trn2_marks_its_inferred_figures():
    trn2 = get_profile("trn2")
    for param in ("prefill_mfu", "decode_step_base_s", "post_s_per_desc"):
        assert getattr(trn2, param).source.startswith("inferred"), param
    assert "INFERRED" in trn2.description


def test_cli_small_sweep_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["--rates", "1,8", "--input-lens", "1024", "--requests", "40", "--output-len", "16",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {(s["mode"], s["rate"]) for s in data["sweep"]} == {(m, r) for m in ("push", "pull") for r in (1.0, 8.0)}
    assert "crossover" in capsys.readouterr().out


def test_cli_rejects_bad_lists():
    with pytest.raises(SystemExit) as exc:
        main(["--rates", "1,fast"])
    assert exc.value.code == 2
