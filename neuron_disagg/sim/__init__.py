"""Discrete-event model of push vs pull prefill/decode disaggregation (``neuron-disagg simulate``).

Import surface: ``simulate(profile, Scenario(...))`` for one run, ``get_profile(name)`` for the
shipped profiles, ``summarize`` for the numbers a benchmark would print.
"""

from .errors import CapacityError, ProfileError, ScenarioError, SimulationError
from .metrics import Summary, summarize
from .model import RunResult, Scenario, simulate
from .params import Geometry, Profile, Sourced
from .profiles import get_profile

__all__ = ["CapacityError", "Geometry", "Profile", "ProfileError", "RunResult", "Scenario", "ScenarioError",
           "SimulationError", "Sourced", "Summary", "get_profile", "simulate", "summarize"]
